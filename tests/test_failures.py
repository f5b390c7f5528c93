"""Failures stay where they belong: one bad request fails alone, a failed forward pass fails
only its step, a dead engine answers everyone and takes the server down (exit status 1).

Every path is provoked with the test-only fault injector (tokenloom/engine/faults.py): in
offline tests it is set on the engine, in the subprocess server through TOKENLOOM_FAULTS.
The victim of a fault is chosen by a marker in its prompt, since servers pick their own
request ids.  "Unaffected" is checked strictly: the other requests' greedy tokens equal
those of the same batch run without any fault.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import httpx
import pytest

from server_fixtures import ThreadedServer, metric, sse_events, wait_until
from tokenloom import LLM, SamplingParams
from tokenloom.bench.launcher import free_port, start_server
from tokenloom.engine.async_engine import AsyncLLMEngine, EngineDeadError
from tokenloom.engine.faults import FaultInjector

ENGINE_KW = dict(max_model_len=256, num_kv_blocks=128, block_size=8, max_num_seqs=2, seed=0)
ENGINE_FLAGS = ["--max-model-len", "256", "--num-kv-blocks", "128", "--block-size", "8", "--seed", "0"]
MARK = "VICTIM"
PROMPTS = [f"{MARK} def f(x):", "import os\n", "class A:\n    def", "x = [1, 2,"]
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=8)
CLIENT_TIMEOUT = 60.0  # every client call is bounded: a hang fails the test instead of stalling it


# ---- offline engine ----------------------------------------------------------------

@pytest.fixture(scope="module")
def llm(tiny_llama: Path) -> LLM:
    # max_num_seqs=2: four prompts run as two batches of two, so a failed step has
    # bystanders (its batch mate) and outsiders (the two still waiting).
    return LLM(str(tiny_llama), **ENGINE_KW)


@pytest.fixture(scope="module")
def reference(llm: LLM) -> list[list[int]]:
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert all(o.error is None and o.outputs[0].finish_reason == "length" for o in outs)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def engine(llm: LLM):
    """The module's engine, with the fault injector and observers restored after each test."""
    e = llm.llm_engine
    observers = list(e.observers)
    yield e
    e.faults = None
    e.observers[:] = observers


def assert_clean(engine) -> None:
    """Nothing running or waiting, nothing on the books, every KV block back in the pool."""
    assert not engine.has_unfinished_requests()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert not engine.scheduler.has_unfinished()
    assert engine.kv_cache_usage() == 0.0
    assert not engine.processor.children


def assert_failed(out, *, stage: str) -> None:
    assert out.finished and out.error is not None and stage in out.error, out.error
    assert [c.finish_reason for c in out.outputs] == ["error"]


@pytest.mark.parametrize("site,stage", [("detokenize", "processing its output"),
                                        ("sample", "sampling its next token")])
def test_one_request_fails_alone(llm, engine, reference, site, stage):
    """A fault attributable to one request (its detokenizer; its sampling, as the runner
    reports it) fails that request alone; its batch mate and the waiting requests produce
    exactly the tokens of a clean run."""
    engine.faults = FaultInjector.parse(f"{site}:{MARK}")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert_failed(outs[0], stage=stage)
    for o, ref in zip(outs[1:], reference[1:]):
        assert o.error is None and o.outputs[0].finish_reason == "length"
        assert o.outputs[0].token_ids == ref
    assert engine.consecutive_failed_steps == 0
    assert_clean(engine)


def test_failure_of_one_sample_fails_its_whole_request(llm, engine, reference):
    """n=3 with prefix caching: samples 1..2 wait for sample 0 to fill the cache.  When
    sample 0 fails, the whole request fails (siblings never admitted are not left behind)."""
    engine.faults = FaultInjector.parse(f"detokenize:{MARK}")
    params = [SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=8), GREEDY, GREEDY, GREEDY]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    assert outs[0].error is not None and [c.finish_reason for c in outs[0].outputs] == ["error"] * 3
    assert [o.outputs[0].token_ids for o in outs[1:]] == reference[1:]
    assert_clean(engine)


def test_forward_failure_fails_only_its_step(llm, engine, reference):
    """A failed forward pass fails the requests of that step (the victim and its batch mate),
    frees their blocks, and leaves the waiting requests untouched."""
    failed_before = engine.num_failed_steps
    engine.faults = FaultInjector.parse(f"forward:{MARK}")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for o in outs[:2]:  # the first step holds prompts 0 and 1 (max_num_seqs=2)
        assert_failed(o, stage="running the model")
        assert o.outputs[0].token_ids == []
    for o, ref in zip(outs[2:], reference[2:]):
        assert o.error is None and o.outputs[0].token_ids == ref
    assert engine.num_failed_steps == failed_before + 1
    assert engine.consecutive_failed_steps == 0  # reset by the good steps after it
    assert engine.device_error is None  # the probe found the CPU fine
    assert_clean(engine)


def test_every_step_failing_still_answers_every_request(llm, engine, reference):
    """A forward pass that always fails (and a device that reports itself broken) cannot
    loop forever: every request comes back with an error, the engine is clean, and the
    next call on a healthy engine is exactly the clean run."""
    engine.faults = FaultInjector.parse("forward:*;device")
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    for o in outs:
        assert_failed(o, stage="running the model")
    assert engine.device_error is not None
    assert_clean(engine)
    engine.faults = None
    engine.device_error = None
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_failed_requests_never_leak_into_the_next_call(llm, engine, reference):
    """generate() returns error outputs for failed requests (it does not raise); the next
    call neither sees them nor is slowed by them."""
    engine.faults = FaultInjector.parse(f"detokenize:{MARK}")
    first = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert first[0].error is not None
    engine.faults = None
    again = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.request_id for o in again] != [o.request_id for o in first]
    assert [o.error for o in again] == [None] * 4
    assert [o.outputs[0].token_ids for o in again] == reference
    assert_clean(engine)


def test_interrupted_generate_leaves_the_engine_clean(llm, engine, reference):
    """An exception out of generate() (here Ctrl-C, raised by an observer at step 2) aborts
    that call's requests before it propagates: nothing runs on into the next call."""
    steps = []

    def interrupt(event) -> None:
        steps.append(event.step)
        if len(steps) == 2:
            raise KeyboardInterrupt

    engine.add_observer(interrupt)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    engine.remove_observer(interrupt)
    assert_clean(engine)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_raising_observer_is_detached_not_fatal(llm, engine, reference, caplog):
    events = []

    def broken(event) -> None:
        raise ValueError("observer bug")

    engine.add_observer(broken)
    engine.add_observer(events.append)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert broken not in engine.observers  # detached after its first failure ...
    assert events and events[0].step < events[-1].step  # ... while the others kept observing
    assert "observer" in caplog.text and "detached" in caplog.text
    assert_clean(engine)


def test_engine_thread_death_answers_everyone(llm, engine):
    """Whatever kills the engine thread, no client waits forever: the request in flight and
    those still in the inbox all fail with EngineDeadError, and later adds are refused.
    (The thread is killed deterministically: an observer holds step 1 open until three
    requests sit in the inbox, then raises a BaseException no containment catches.)"""
    class Crash(BaseException):
        pass

    entered, release = threading.Event(), threading.Event()

    def blocker(event) -> None:
        entered.set()
        release.wait(CLIENT_TIMEOUT)
        raise Crash

    engine.add_observer(blocker)
    ids = engine.process_prompt(PROMPTS[1])[1]

    async def drain(stream) -> None:
        async for _ in stream:
            pass

    async def main() -> AsyncLLMEngine:
        a = AsyncLLMEngine(engine)
        a.start()
        first = a.add_request("first", None, ids, GREEDY)
        assert await asyncio.to_thread(entered.wait, CLIENT_TIMEOUT)
        queued = [a.add_request(f"queued-{i}", None, ids, GREEDY) for i in range(3)]
        release.set()
        for stream in (first, *queued):
            with pytest.raises(EngineDeadError):
                await asyncio.wait_for(drain(stream), CLIENT_TIMEOUT)
        with pytest.raises(EngineDeadError):
            a.add_request("late", None, ids, GREEDY)
        a.shutdown()
        return a

    a = asyncio.run(main())
    assert not a.is_running and "crashed (Crash)" in (a.dead_reason or "")
    assert_clean(engine)


def test_fault_spec_parsing():
    f = FaultInjector.parse("forward:r1; detokenize:MARK ;device")
    assert f.matches("forward", "r1") and not f.matches("forward", "r10")
    assert f.matches("forward", "r1-3")  # sample 3 of the n>1 request r1
    assert f.matches("detokenize", "cmpl-x-0", "a MARK b") and not f.matches("detokenize", "cmpl-x-0", "a b")
    assert f.device_broken() and not FaultInjector.parse("forward:*").device_broken()
    with pytest.raises(ValueError, match="unknown fault site"):
        FaultInjector.parse("backward:*")


# ---- the server ------------------------------------------------------------------

def _complete(base_url: str, prompt: str, **kw) -> httpx.Response:
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **kw}
    return httpx.post(base_url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT)


def _error(resp: httpx.Response, status: int, code: str) -> dict:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert body["error"]["code"] == code, body
    assert "injected" not in body["error"]["message"]  # the exception's text stays in the log
    return body["error"]


def _idle(base_url: str) -> bool:
    return (metric(base_url, "tokenloom:num_requests_running") == 0
            and metric(base_url, "tokenloom:num_requests_waiting") == 0
            and metric(base_url, "tokenloom:kv_cache_usage_perc") == 0)


def _concurrently(fns) -> list:
    results: list = [None] * len(fns)

    def run(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # surfaced by the assertion below
            results[i] = e

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(CLIENT_TIMEOUT + 10)
    assert not any(t.is_alive() for t in threads), "a client was left waiting"
    return results


@pytest.fixture(scope="module")
def server(tiny_llama: Path):
    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), *ENGINE_FLAGS, "--max-failed-steps", "2",
                        "--log-level", "warning", "--disable-access-log"]).start()
    yield s
    s.server.engine.engine.faults = None
    s.stop()


@pytest.fixture(scope="module")
def server_reference(llm: LLM) -> dict[str, str]:
    """What the server must answer for the bystanders: the same prompts, run one at a time."""
    return {p: llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].text for p in PROMPTS[1:]}


def test_server_one_bad_request_fails_alone(server, server_reference):
    """A request whose detokenizer fails gets a 500 in OpenAI's shape (and a streamed one an
    error event and [DONE]); concurrent requests answer exactly as if it had never existed."""
    engine = server.engine.engine
    engine.faults = FaultInjector.parse(f"detokenize:{MARK}")
    try:
        def stream_victim():
            body = {"prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0, "stream": True}
            with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=CLIENT_TIMEOUT) as r:
                return r.status_code, sse_events(r.iter_lines())

        results = _concurrently([lambda: _complete(server.base_url, PROMPTS[0]), stream_victim,
                                 *[(lambda p=p: _complete(server.base_url, p)) for p in PROMPTS[1:]]])
        _error(results[0], 500, "engine_error")
        status, events = results[1]
        assert status == 200 and events[-1] == "[DONE]" and events[-2]["error"]["code"] == "engine_error"
        for p, resp in zip(PROMPTS[1:], results[2:]):
            assert resp.status_code == 200, resp.text
            assert resp.json()["choices"][0]["text"] == server_reference[p]
    finally:
        engine.faults = None
    assert wait_until(lambda: _idle(server.base_url), 10)
    assert httpx.get(server.base_url + "/health", timeout=CLIENT_TIMEOUT).status_code == 200
    assert metric(server.base_url, "tokenloom:request_success_total", finished_reason="error") >= 2


def test_server_forward_failure_and_raising_observer(server, server_reference):
    """One failed step (below --max-failed-steps) fails its requests only; an observer that
    raises is detached; the server stays healthy and the next request is exact."""
    engine = server.engine.engine
    engine.faults = FaultInjector.parse(f"forward:{MARK}")

    def broken(event) -> None:
        raise RuntimeError("observer bug")

    engine.add_observer(broken)
    try:
        _error(_complete(server.base_url, PROMPTS[0]), 500, "engine_error")
    finally:
        engine.faults = None
    resp = _complete(server.base_url, PROMPTS[1])
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == server_reference[PROMPTS[1]]
    assert broken not in engine.observers
    assert httpx.get(server.base_url + "/health", timeout=CLIENT_TIMEOUT).status_code == 200
    assert wait_until(lambda: _idle(server.base_url), 10)


def test_server_health_503_after_repeated_failures(tiny_llama: Path):
    """--max-failed-steps 2 failed steps in a row kill the engine: every client in flight,
    waiting or still in the inbox gets an answer, /health turns 503, new requests get 503.
    (--no-exit-on-engine-failure keeps the process up so the 503 can be observed.)"""
    s = ThreadedServer([str(tiny_llama), "--port", str(free_port()), *ENGINE_FLAGS, "--max-failed-steps", "2",
                        "--max-num-seqs", "2", "--no-exit-on-engine-failure", "--log-level", "critical",
                        "--disable-access-log"]).start()
    try:
        assert httpx.get(s.base_url + "/health", timeout=CLIENT_TIMEOUT).status_code == 200
        s.engine.engine.faults = FaultInjector.parse("forward:*")
        _error(_complete(s.base_url, PROMPTS[1]), 500, "engine_error")  # failed step 1 of 2
        # Step 2 fails two of these (--max-num-seqs 2); the rest wait, or are still in the inbox.
        results = _concurrently([(lambda i=i: _complete(s.base_url, f"{i} " + PROMPTS[1], max_tokens=32))
                                 for i in range(12)])
        for r in results:
            assert isinstance(r, httpx.Response), r
            assert r.status_code in (500, 503), r.text
            _error(r, r.status_code, "engine_error" if r.status_code == 500 else "engine_unavailable")
        health = httpx.get(s.base_url + "/health", timeout=CLIENT_TIMEOUT)
        assert health.status_code == 503 and "failed steps in a row" in health.json()["error"]["message"]
        _error(_complete(s.base_url, PROMPTS[1]), 503, "engine_unavailable")
        assert s.engine.engine.kv_cache_usage() == 0.0
        assert s.server.engine_failed is not None and not s.server.should_exit
    finally:
        s.stop()


@pytest.fixture(scope="module", autouse=True)
def device_fault_server(tiny_llama: Path, tmp_path_factory):
    """`tokenloom serve` as a real process whose device "breaks" at the first forward pass of
    a marked request.  Launched in the background when the module starts, so its imports
    and model load overlap the other tests."""
    log = tmp_path_factory.mktemp("faultsrv") / "serve.log"
    holder: dict = {}

    def launch() -> None:
        try:
            holder["server"] = start_server(
                str(tiny_llama), [*ENGINE_FLAGS, "--log-level", "warning"], port=free_port(), log_path=log,
                env={"TOKENLOOM_FAULTS": f"forward:{MARK};device"}, timeout=240)
        except BaseException as e:  # surfaced when the test asks for the server
            holder["error"] = e

    t = threading.Thread(target=launch, daemon=True)
    t.start()

    def get():
        t.join(300)
        if "error" in holder:
            raise holder["error"]
        return holder["server"], log

    yield get
    t.join(300)  # never leave a half-started server behind
    if "server" in holder:
        holder["server"].stop()


def test_server_exits_nonzero_when_the_device_breaks(device_fault_server):
    """`tokenloom serve` as a real process: healthy until a forward pass fails and the device
    probe finds the device broken; then the client gets its error and the process exits
    with status 1, so a supervisor restarts it."""
    srv, log = device_fault_server()
    assert _complete(srv.base_url, PROMPTS[1]).status_code == 200
    resp = _complete(srv.base_url, PROMPTS[0])
    assert resp.status_code in (500, 503), resp.text
    assert srv.proc.wait(timeout=60) == 1
    assert "the device is broken" in log.read_text()
