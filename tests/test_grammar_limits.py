"""Grammar compilation is bounded and cancellable (issue 37 items 1-2), through real HTTP.

The server compiles each request's grammar in a worker process it can kill
(`tokenloom/structured/compile_pool.py`): a compilation that outlives
--max-grammar-compile-seconds is a 400 naming the field the client used, one whose client
disconnects is stopped (its worker killed and replaced), and the compiled grammars kept are
bounded in bytes (--max-grammar-cache-bytes, visible in /metrics).  A grammar whose parse
error quotes a non-ASCII character is a 400 like any other, not a 500.

A JSON schema nested N objects deep is the costly input: on the tiny model's 1,024-token
vocabulary depth 200 takes ~2 s of CPU to compile, 300 ~6.5 s, 400 ~16 s.
"""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import pytest

pytest.importorskip("xgrammar")

from server_fixtures import ThreadedServer, metric, wait_until  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402

NAME = "tiny"
LIMIT_S = 2.0


def nested(depth: int, tag: str = "") -> dict:
    """An object schema `depth` levels deep: {"a": {"a": ... "string"}}."""
    s: dict = {"type": "string", "description": tag} if tag else {"type": "string"}
    for _ in range(depth):
        s = {"type": "object", "properties": {"a": s}, "required": ["a"]}
    return s


@pytest.fixture(scope="module")
def server(tiny_llama):
    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "256",
                        "--num-kv-blocks", "64", "--max-num-seqs", "8", "--seed", "0",
                        "--served-model-name", NAME, "--log-level", "warning", "--disable-access-log",
                        "--max-grammar-compile-seconds", str(LIMIT_S), "--max-concurrent-grammar-compiles", "1",
                        "--max-grammar-cache-bytes", "2000000"]).start()
    yield s
    s.stop()


def post(server, body: dict, timeout: float = 120.0) -> httpx.Response:
    return httpx.post(server.base_url + "/v1/completions", json={"model": NAME, "prompt": "x", **body},
                      timeout=timeout)


def pool_stats(server):
    return server.engine.engine.grammars.stats()["pool"]


@pytest.mark.parametrize("body, param", [
    ({"guided_grammar": "é("}, "guided_grammar"),
    ({"structured_outputs": {"grammar": "é("}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": 'root ::= "a" | ☕'}}, "structured_outputs"),
    ({"guided_regex": "é("}, "guided_regex"),
])
def test_non_ascii_grammar_error_is_a_400(server, body, param):
    r = post(server, {"max_tokens": 4, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    # The server carries on, grammars included.
    ok = post(server, {"max_tokens": 8, "guided_choice": ["ok"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "ok"


def test_costly_schema_is_stopped_at_the_limit_while_others_are_served(server):
    before = pool_stats(server).timeouts
    deep = nested(400)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", post(server, {"max_tokens": 4, "guided_json": deep})))
    t.start()
    assert wait_until(lambda: pool_stats(server).busy == 1 or not t.is_alive(), timeout=60)
    # While the worker compiles, the server answers others (plain, and with a cached grammar).
    plain = post(server, {"max_tokens": 4})
    assert plain.status_code == 200, plain.text
    t.join(120)
    r = out["r"]
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "guided_json" and err["code"] == "limit_exceeded", err
    assert "--max-grammar-compile-seconds" in err["message"]
    assert pool_stats(server).timeouts == before + 1
    # The same field name is blamed whichever way the schema came, and the spec that ran out
    # of time is refused at once when asked again (no second worker burnt on it).
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": deep}}
    r2 = post(server, {"max_tokens": 4, "response_format": fmt})
    assert r2.status_code == 400 and r2.json()["error"]["param"] == "response_format", r2.text[:300]
    assert r2.json()["error"]["code"] == "limit_exceeded"
    assert pool_stats(server).timeouts == before + 1
    # A fresh worker serves the next grammar.
    ok = post(server, {"max_tokens": 8, "guided_choice": ["fine"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "fine"


def test_client_that_disconnects_frees_the_worker(server):
    import psutil

    ok = post(server, {"max_tokens": 8, "guided_choice": ["warm"]})  # a worker is up
    assert ok.status_code == 200
    before = pool_stats(server)
    (old_pid,) = before.worker_pids
    out: dict = {}

    def give_up() -> None:
        try:  # the client waits less than the compilation takes, then closes its connection
            out["r"] = post(server, {"max_tokens": 4, "guided_json": nested(300, "bye")}, timeout=0.5)
        except httpx.TimeoutException as e:
            out["e"] = e

    t = threading.Thread(target=give_up)
    t.start()
    t.join(60)
    assert "e" in out, out
    # The worker that was compiling for nobody is killed and replaced.
    assert wait_until(lambda: pool_stats(server).abandoned == before.abandoned + 1, timeout=30), pool_stats(server)
    assert wait_until(lambda: pool_stats(server).worker_pids and pool_stats(server).worker_pids != [old_pid],
                      timeout=60), pool_stats(server)
    assert not psutil.pid_exists(old_pid) or psutil.Process(old_pid).status() == psutil.STATUS_ZOMBIE
    after = pool_stats(server)
    assert after.timeouts == before.timeouts and after.busy == 0
    (new_pid,) = after.worker_pids
    assert psutil.Process(new_pid).cpu_percent(interval=1.0) < 50  # idle: nothing compiles on
    ok = post(server, {"max_tokens": 8, "guided_choice": ["again"]})
    assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "again"


def test_compiled_grammar_cache_is_bounded_in_bytes(server):
    limit = metric(server.base_url, "tokenloom:grammar_cache_limit_bytes")
    assert limit == 2000000
    schemas = [nested(60, f"s{i}") for i in range(8)]  # ~640 KB each once compiled
    for s in schemas:
        r = post(server, {"max_tokens": 2, "guided_json": s})
        assert r.status_code == 200, r.text[:300]
        held = metric(server.base_url, "tokenloom:grammar_cache_bytes")
        assert 0 < held <= limit
    entries = metric(server.base_url, "tokenloom:grammar_cache_entries")
    assert 1 <= entries < len(schemas)
    # The least recently used went first; asking for it again compiles it again, fine.
    compiled = pool_stats(server).compiled
    r = post(server, {"max_tokens": 2, "guided_json": schemas[0]})
    assert r.status_code == 200 and pool_stats(server).compiled == compiled + 1
    r = post(server, {"max_tokens": 2, "guided_json": schemas[0]})  # and now it is cached
    assert r.status_code == 200 and pool_stats(server).compiled == compiled + 1
    assert metric(server.base_url, "tokenloom:grammar_cache_bytes") <= limit
    assert json.loads(r.text)["choices"]


def test_workers_stop_with_the_server(tiny_llama):
    import psutil

    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "128",
                        "--num-kv-blocks", "32", "--served-model-name", NAME, "--log-level", "warning",
                        "--disable-access-log"]).start()
    try:
        r = post(s, {"max_tokens": 8, "guided_choice": ["up"]})
        assert r.status_code == 200
        pids = s.engine.engine.grammars.stats()["pool"].worker_pids
        assert pids and all(psutil.pid_exists(p) for p in pids)
    finally:
        s.stop()
    assert wait_until(lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                      for p in pids), timeout=30), pids


def test_no_worker_outlives_a_killed_server(tiny_llama, tmp_path):
    """`tokenloom serve` as its own process, SIGKILLed mid-compilation: its compile worker
    (a grandchild, forked by multiprocessing's forkserver) and the forkserver go with it."""
    import psutil

    from tokenloom.bench.launcher import start_server

    srv = start_server(str(tiny_llama), ["--max-model-len", "128", "--num-kv-blocks", "32", "--served-model-name", NAME,
                                         "--max-grammar-compile-seconds", "300"],
                       log_path=tmp_path / "serve.log", timeout=300)
    try:
        me = psutil.Process(srv.proc.pid)
        body = {"model": NAME, "prompt": "x", "max_tokens": 4, "guided_json": nested(450, "killed")}

        def ask() -> None:
            with contextlib.suppress(httpx.HTTPError):
                httpx.post(srv.base_url + "/v1/completions", json=body, timeout=300)

        threading.Thread(target=ask, daemon=True).start()

        def compiling_worker() -> list:
            kids = me.children(recursive=True)
            direct = {k.pid for k in me.children()}
            return [k for k in kids if k.pid not in direct and k.cpu_percent(0.2) > 10]

        assert wait_until(compiling_worker, timeout=120), "no compile worker process compiled the grammar"
        family = me.children(recursive=True)
    finally:
        srv.proc.kill()
        srv.proc.wait(30)

    def alive() -> list[int]:
        out = []
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
        return out

    assert wait_until(lambda: not alive(), timeout=30), alive()
