"""The router (`tokenloom router`) and data-parallel serving (`serve --data-parallel-size`).

Policies are tested as the plain classes the simulator also runs; the router is tested in
front of two real `tokenloom serve` processes on 127.0.0.1 with the official openai client,
one of them killed mid-run.  Data parallel: a real `serve --data-parallel-size 2` process
tree, stopped with SIGTERM.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

from server_fixtures import metric, metric_values, sse_events, wait_until
from tokenloom.bench.launcher import ServerProcess, free_port
from tokenloom.router.metrics import add_label, merge_expositions
from tokenloom.router.policy import (CacheAware, LeastLoaded, PrefixRecord, RoundRobin, block_hashes, make_policy,
                                     prompt_key)
from tokenloom.router.server import build_router_server

pytestmark = pytest.mark.timeout(300)

BACKEND = "x-tokenloom-backend"


# ---------------------------------------------------------------- policies (pure Python)
def test_round_robin_takes_turns_and_skips_missing_backends():
    p = RoundRobin(3)
    assert [p.choose(None, [0, 1, 2], [0, 0, 0]) for _ in range(4)] == [0, 1, 2, 0]
    assert [p.choose(None, [0, 2], [0, 0, 0]) for _ in range(3)] == [2, 0, 2]


def test_least_loaded_picks_fewest_in_flight_and_spreads_ties():
    p = LeastLoaded(3)
    assert p.choose(None, [0, 1, 2], [5, 1, 3]) == 1
    assert p.choose(None, [0, 2], [5, 1, 3]) == 2
    picks = [p.choose(None, [0, 1, 2], [0, 0, 0]) for _ in range(6)]
    assert sorted(picks) == [0, 0, 1, 1, 2, 2]


def test_cache_aware_follows_the_longest_prefix_and_falls_back_when_imbalanced():
    p = CacheAware(2, balance_threshold=2, block_chars=8)
    a, b = "A" * 40, "B" * 40  # five blocks each; the suffixes below are a sixth
    first_a = p.choose(a + "one_____", [0, 1], [0, 0])
    first_b = p.choose(b + "one_____", [0, 1], [0, 0])
    assert first_a != first_b  # no match anywhere: least-loaded, ties in turn
    for suffix in ("two_____", "three___", "four____"):
        assert p.choose(a + suffix, [0, 1], [0, 0]) == first_a
        assert p.choose(b + suffix, [0, 1], [0, 0]) == first_b
    assert p.matches(a + "zzz") == ([5, 0] if first_a == 0 else [0, 5])
    loads = [0, 0]
    loads[first_a] = 2  # busier by the threshold: still the cache
    assert p.choose(a + "five____", [0, 1], loads) == first_a
    loads[first_a] = 3  # busier by more: least-loaded wins
    assert p.choose(a + "six_____", [0, 1], loads) == 1 - first_a
    # The longer match (six blocks there, five here) wins, and a missing candidate is never picked.
    assert p.choose(a + "six_____", [0, 1], [0, 0]) == 1 - first_a
    assert p.choose(a, [first_a], [9, 9]) == first_a
    p.backend_down(1 - first_a)
    assert p.matches(a + "six_____")[1 - first_a] == 0


def test_cache_aware_balances_a_prompt_shorter_than_a_block():
    p = CacheAware(2)
    assert sorted(p.choose("hi", [0, 1], [0, 0]) for _ in range(4)) == [0, 0, 1, 1]


def test_block_hashes_are_chained_over_full_blocks():
    h1 = block_hashes("x" * 20 + "y" * 10, block_chars=10)
    h2 = block_hashes("x" * 20 + "z" * 10, block_chars=10)
    assert len(h1) == 3 and h1[:2] == h2[:2] and h1[2] != h2[2]
    assert block_hashes("short", block_chars=10) == []
    assert block_hashes("y" * 10 + "x" * 10, block_chars=10)[1] != h1[1]  # the same block, another parent
    ids = tuple(range(40))
    assert len(block_hashes(ids, block_tokens=16)) == 2


def test_prompt_key_reads_completions_chat_and_token_ids():
    assert prompt_key({"prompt": "hello"}) == "hello"
    assert prompt_key({"prompt": ["first", "second"]}) == "first"
    assert prompt_key({"prompt": [1, 2, 3]}) == (1, 2, 3)
    assert prompt_key({"prompt": [[4, 5], [6]]}) == (4, 5)
    assert prompt_key({"model": "m"}) is None and prompt_key("not a dict") is None
    short = prompt_key({"messages": [{"role": "user", "content": "hi"}]})
    longer = prompt_key({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]})
    assert longer.startswith(short)


def test_prefix_record_forgets_least_recently_used():
    r = PrefixRecord(capacity=3)
    r.insert([b"a", b"b", b"c"])
    r.insert([b"a"])  # a is fresh again
    r.insert([b"d"])  # b goes
    assert r.match([b"a"]) == 1 and r.match([b"b"]) == 0 and len(r) == 3


def test_make_policy_names():
    assert isinstance(make_policy("cache-aware", 2, balance_threshold=1), CacheAware)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random", 2)


def test_merge_expositions_labels_every_sample_and_writes_headers_once():
    text = ('# HELP tokenloom:x_total X.\n# TYPE tokenloom:x_total counter\ntokenloom:x_total{model_name="m"} 3.0\n'
            '# HELP tokenloom:y Y.\n# TYPE tokenloom:y gauge\ntokenloom:y 1.0\n')
    merged = merge_expositions([("0", text), ("1", text.replace("3.0", "4.0"))])
    assert merged.count("# TYPE tokenloom:x_total counter") == 1
    assert metric_values(merged, "tokenloom:x_total", engine="0") == [3.0]
    assert metric_values(merged, "tokenloom:x_total", engine="1", model_name="m") == [4.0]
    assert metric_values(merged, "tokenloom:y", engine="1") == [1.0]
    assert add_label("a{} 1", "engine", "2") == 'a{engine="2"} 1'


def test_data_parallel_replicas_inherit_the_users_flags_and_split_the_cpu():
    from tokenloom.entrypoints.cli import build_parser
    from tokenloom.entrypoints.cmd_serve import _replica_reference_parser
    from tokenloom.entrypoints.data_parallel import placement, spell_flags

    argv = ["serve", "some/model", "-dp", "2", "--port", "9000", "--served-model-name", "a", "b", "--device", "cpu",
            "--max-num-seqs", "8", "--no-enable-prefix-caching", "--enforce-eager"]
    args = build_parser().parse_args(argv)
    assert spell_flags(_replica_reference_parser(), args) == [
        "--served-model-name", "a", "b", "--device", "cpu", "--max-num-seqs", "8", "--no-enable-prefix-caching",
        "--enforce-eager"]  # where to listen and how many replicas are the front's business
    cores = len(os.sched_getaffinity(0))
    places = placement(args, 2)
    for p in places:
        assert p.env == {} and p.flags[:2] == ["--num-threads", str(max(1, cores // 2))]
        assert p.flags[2] == "--kv-cache-memory" and int(p.flags[3]) > 0
    sized = build_parser().parse_args([*argv, "--kv-cache-memory", "1GiB", "--num-threads", "3"])
    assert "--kv-cache-memory" not in placement(sized, 2)[0].flags
    assert placement(sized, 2)[1].flags == ["--num-threads", "3"]
    spelled = spell_flags(_replica_reference_parser(), sized)
    assert spelled[spelled.index("--kv-cache-memory") + 1] == "1GiB" and "--num-threads" not in spelled


# ---------------------------------------------------------------- live servers
# One process tree serves every test below, in file order (starting engines is the slow part):
# `tokenloom serve --data-parallel-size 2` -- a front process (router) and two replicas, each
# a plain `tokenloom serve`.  The replicas double as the backends of the `tokenloom router`
# tests; the last tests kill one replica mid-run, then stop the front with SIGTERM.

MODEL_NAME = [""]  # what the servers serve: the model directory's name (serve's default id for a path)


def _children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        out += [int(c) for c in (task / "children").read_text().split()]
    return out


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _port_of(pid: int) -> int:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return int(argv[argv.index("--port") + 1])


@dataclass
class Fleet:
    front: ServerProcess
    replica_pids: list[int]  # in the order of `backends`
    backends: list[str]  # the replicas' base URLs


@pytest.fixture(scope="module")
def fleet(tiny_llama, tmp_path_factory) -> Fleet:
    if not Path("/proc/self/task").exists():
        pytest.skip("reads the process tree from /proc")
    MODEL_NAME[0] = tiny_llama.name  # 1024 positions: room for the long requests below
    port = free_port()
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", str(tiny_llama), "--port", str(port),
           "--data-parallel-size", "2", "--num-threads", "1"]
    log = tmp_path_factory.mktemp("dp") / "serve.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    front = ServerProcess(proc=proc, host="127.0.0.1", port=port, log_path=log, cmd=cmd)
    try:
        with httpx.Client(timeout=2.0) as http:  # one client for the polls: cheap on shared cores
            def healthy() -> bool:
                assert proc.poll() is None, f"serve exited ({proc.returncode}):\n{front.log_tail()}"
                with contextlib.suppress(httpx.HTTPError):
                    return http.get(front.base_url + "/health").status_code == 200
                return False

            assert wait_until(healthy, 240, interval=0.25), front.log_tail()
        pids = sorted(_children(front.proc.pid))
        yield Fleet(front, pids, [f"http://127.0.0.1:{_port_of(p)}" for p in pids])
    finally:
        front.stop()


class ThreadedRouter:
    """`build_router_server` run by uvicorn in a thread of the test process."""

    def __init__(self, urls: list[str], policy: str, **kw):
        args = argparse.Namespace(policy=policy, balance_threshold=kw.pop("balance_threshold", 4),
                                  health_interval=kw.pop("health_interval", 0.5), host="127.0.0.1",
                                  port=free_port(), log_level="warning", disable_access_log=True)
        self.server, self.router = build_router_server(urls, args, **kw)
        self.base_url = f"http://127.0.0.1:{args.port}"
        self.urls = urls
        self._thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> "ThreadedRouter":
        self._thread.start()
        assert wait_until(lambda: self.server.started or not self._thread.is_alive(), 30)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(30)

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)

    def metric(self, name: str, backend: int | None = None) -> float:
        labels = {} if backend is None else {"backend": self.urls[backend]}
        return sum(metric_values(httpx.get(self.base_url + "/metrics").text, name, **labels))


def _complete(base_url: str, prompt: str, **kw) -> httpx.Response:
    body = {"model": MODEL_NAME[0], "prompt": prompt, "max_tokens": 8, "temperature": 0, **kw}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=120)


def test_serve_data_parallel_routes_over_its_replicas(fleet):
    assert len(fleet.replica_pids) == 2
    c = openai.OpenAI(base_url=fleet.front.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)
    assert [m.id for m in c.models.list().data] == [MODEL_NAME[0]]
    direct = openai.OpenAI(base_url=fleet.backends[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    for i in range(4):  # distinct prompts: no prefix to follow, so the idle replicas take turns
        prompt = f"distinct prompt number {i}"
        got = c.completions.create(model=MODEL_NAME[0], prompt=prompt, max_tokens=6, temperature=0)
        want = direct.completions.create(model=MODEL_NAME[0], prompt=prompt, max_tokens=6, temperature=0)
        assert got.choices[0].text == want.choices[0].text
    text = httpx.get(fleet.front.base_url + "/metrics").text
    for url in fleet.backends:  # both replicas served the front's requests
        assert sum(metric_values(text, "tokenloom:router_requests_total", backend=url)) >= 2
    for engine in ("0", "1"):  # every replica's series, labelled with its engine
        assert sum(metric_values(text, "tokenloom:request_success_total", engine=engine)) >= 2
        assert metric_values(text, "tokenloom:kv_cache_usage_perc", engine=engine)
    assert text.count("# TYPE tokenloom:request_success_total counter") == 1
    assert httpx.get(fleet.front.base_url + "/health").status_code == 200


def test_router_passes_completions_chat_and_streams_through(fleet):
    name = MODEL_NAME[0]
    direct = openai.OpenAI(base_url=fleet.backends[0] + "/v1", api_key="unused", max_retries=0, timeout=60)
    with ThreadedRouter(fleet.backends, "round-robin") as r:
        c = r.client()
        assert [m.id for m in c.models.list().data] == [name]
        prompt = "the quick brown fox"
        want = direct.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
        for _ in range(2):  # both backends (round-robin): each gives the direct answer
            assert c.completions.create(model=name, prompt=prompt, max_tokens=12, temperature=0).choices[0].text == want
        # A long stream arrives in pieces while the backend is still generating it.
        long = {"model": name, "prompt": prompt, "max_tokens": 300, "temperature": 0, "ignore_eos": True}
        want_long = httpx.post(fleet.backends[0] + "/v1/completions", json=long, timeout=120).json()
        with httpx.stream("POST", r.base_url + "/v1/completions", json={**long, "stream": True}, timeout=120) as resp:
            assert resp.headers["content-type"].startswith("text/event-stream")
            served_by = fleet.backends[int(resp.headers[BACKEND])]
            lines = resp.iter_lines()
            events = next(sse_events([line]) for line in lines if line.startswith("data:"))
            running_at_first_chunk = metric(served_by, "tokenloom:num_requests_running")
            events += sse_events(lines)
        assert running_at_first_chunk == 1
        assert events[-1] == "[DONE]"
        assert "".join(e["choices"][0]["text"] for e in events[:-1] if e["choices"]) == want_long["choices"][0]["text"]
        msgs = [{"role": "user", "content": "hello there"}]
        want_chat = direct.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0)
        stream = c.chat.completions.create(model=name, messages=msgs, max_tokens=10, temperature=0, stream=True)
        got = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
        assert got == want_chat.choices[0].message.content
        tok = httpx.post(r.base_url + "/tokenize", json={"model": name, "prompt": prompt}).json()
        assert tok["count"] == len(tok["tokens"]) > 0
        # A client error is the backend's answer, passed through and never retried.
        with pytest.raises(openai.BadRequestError) as e:
            c.completions.create(model=name, prompt=prompt, max_tokens=-1)
        assert e.value.status_code == 400 and e.value.body["type"] == "invalid_request_error"
        assert r.metric("tokenloom:router_retries_total") == 0
        assert r.metric("tokenloom:router_requests_total", 0) >= 2 and r.metric("tokenloom:router_requests_total", 1) >= 2


def test_router_policies_route_as_specified(fleet):
    urls = fleet.backends
    with ThreadedRouter(urls, "round-robin") as r:
        assert [_complete(r.base_url, f"p{i}").headers[BACKEND] for i in range(4)] == ["0", "1", "0", "1"]
    shared = "You are a careful assistant. Here is a long document that every question is about. " * 4
    other = "An unrelated system prompt that shares nothing with the first one, also quite long. " * 4
    with ThreadedRouter(urls, "cache-aware") as r:
        first = {_complete(r.base_url, shared + f"question {i}?").headers[BACKEND] for i in range(4)}
        second = {_complete(r.base_url, other + f"question {i}?").headers[BACKEND] for i in range(4)}
        assert len(first) == 1 and len(second) == 1 and first != second
    with ThreadedRouter(urls, "least-loaded") as r:
        # Six streams of one prompt opened one after another: least-loaded ignores the shared
        # prefix and splits them 3/3 (by load while they run, in turn once they are done).
        body = {"model": MODEL_NAME[0], "prompt": shared, "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.Client(base_url=r.base_url, timeout=60) as http, contextlib.ExitStack() as streams:
            got = []
            for _ in range(6):
                resp = streams.enter_context(http.stream("POST", "/v1/completions", json=body))
                assert resp.status_code == 200
                next(resp.iter_lines())
                got.append(resp.headers[BACKEND])
            assert sorted(got) == ["0", "0", "0", "1", "1", "1"]
        # Streams closed early: the router forgets them and the backends abort them.
        assert wait_until(lambda: r.metric("tokenloom:router_in_flight") == 0, 10)
        assert wait_until(lambda: sum(metric(u, "tokenloom:num_requests_running") for u in urls) == 0, 10)


def test_router_command_line(fleet, capsys):
    from tokenloom.entrypoints.cli import main

    assert main(["router", "--backend", "localhost:8000"]) == 2
    assert "base URL" in capsys.readouterr().err
    port = free_port()
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "router", "--port", str(port), "--policy", "round-robin",
           "--disable-access-log", *[a for u in fleet.backends for a in ("--backend", u)]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        base = f"http://127.0.0.1:{port}"
        with httpx.Client(timeout=5.0) as http:
            def up() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return http.get(base + "/health").status_code == 200
                return proc.poll() is not None

            assert wait_until(up, 60, interval=0.2) and proc.poll() is None
        assert [_complete(base, "via the command").headers[BACKEND] for _ in range(2)] == ["0", "1"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read().decode()[-2000:]


def test_router_survives_a_backend_killed_mid_run(fleet):
    """Requests in flight on a backend that dies are retried on the other (none had started
    streaming to its client); a stream that had started ends with an error event instead;
    the dead backend leaves rotation."""
    with ThreadedRouter(fleet.backends, "least-loaded", health_interval=0.3) as r, \
            httpx.Client(timeout=60) as http, contextlib.ExitStack() as held:
        stream_body = {"model": MODEL_NAME[0], "prompt": "a long story", "max_tokens": 900, "ignore_eos": True,
                       "stream": True}
        stream = held.enter_context(http.stream("POST", r.base_url + "/v1/completions", json=stream_body))
        assert stream.headers[BACKEND] == "0"  # the first request of an idle fleet
        lines = stream.iter_lines()
        assert next(lines).startswith("data:")
        n = 8
        with ThreadPoolExecutor(n) as pool:
            futures = [pool.submit(_complete, r.base_url, f"request {i} " * 8, max_tokens=400, ignore_eos=True)
                       for i in range(n)]
            # Kill backend 0 once it is busy with its share of the requests (and the stream).
            assert wait_until(lambda: r.router.backends[0].in_flight >= 3, 30)
            os.kill(fleet.replica_pids[0], signal.SIGKILL)
            results = [f.result() for f in futures]
        assert [res.status_code for res in results] == [200] * n
        assert all(res.json()["usage"]["completion_tokens"] == 400 for res in results)
        retried = r.metric("tokenloom:router_retries_total", 0)
        assert retried >= 2  # at least those in flight on backend 0 when it died (the stream aside)
        assert sum(res.headers[BACKEND] == "1" for res in results) >= retried
        assert r.metric("tokenloom:router_failed_requests_total") == 0
        events = sse_events(lines)  # the stream was committed to backend 0: cut, not retried
        stream.close()
        assert "[DONE]" not in events and events[-1]["error"]["code"] == "backend_failed"
        assert r.metric("tokenloom:router_stream_errors_total", 0) == 1
        assert wait_until(lambda: r.metric("tokenloom:router_backend_healthy", 0) == 0, 10)
        assert httpx.get(r.base_url + "/health").status_code == 200
        before = r.metric("tokenloom:router_requests_total", 0)
        assert {_complete(r.base_url, f"after {i}").headers[BACKEND] for i in range(3)} == {"1"}
        assert r.metric("tokenloom:router_requests_total", 0) == before  # out of rotation
    # The data-parallel front routes around its dead replica too.
    assert _complete(fleet.front.base_url, "still served").status_code == 200
    assert httpx.get(fleet.front.base_url + "/health").status_code == 200


def test_serve_data_parallel_stops_its_replicas_on_sigterm(fleet):
    assert _alive(fleet.replica_pids[1])
    fleet.front.proc.send_signal(signal.SIGTERM)
    assert fleet.front.proc.wait(timeout=60) == 0
    assert not [p for p in fleet.replica_pids if _alive(p)]
    # With every backend gone a router answers 503, on /health and on requests.
    with ThreadedRouter(fleet.backends, "cache-aware") as r:
        health = httpx.get(r.base_url + "/health")
        assert health.status_code == 503 and health.json()["error"]["code"] == "no_backend"
        err = _complete(r.base_url, "nobody home")
        assert err.status_code == 503 and err.json()["error"]["type"] == "service_unavailable_error"
        assert r.metric("tokenloom:router_failed_requests_total") == 1
