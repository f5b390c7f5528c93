"""Async scheduling (`--async-scheduling`, core/lookahead.py): the same tokens with overlap on and off.

On the CPU the forward pass is synchronous, so the overlap gives no speed here; what these tests
check is the logic the GPU relies on: step N+1 is launched from step N's tokens on the device,
and a request that ends with step N's token (EOS, stop token, stop string, max_tokens, abort)
never shows the extra token; preemption, n > 1 with prefix caching, logprobs, penalties,
min_tokens and structured output give the same greedy (or seeded) tokens and finish reasons,
and every KV block comes back.  With n-gram speculation: tests/test_spec_decode.py.
"""

from __future__ import annotations

import httpx
import pytest
import torch

from tokenloom import EngineArgs, SamplingParams
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.sampling_params import StructuredOutputsParams

from server_fixtures import ThreadedServer, sse_events

PROMPTS = ["def f(x):", "import os", "class A:", "hello world, hello world", "for i in range(10):",
           "x = 1\ny = 2\n", "print('a')", "while True:"]


def _engine(model, on: bool, **kw) -> LLMEngine:
    args = dict(model=str(model), max_model_len=128, num_kv_blocks=96, block_size=8, async_scheduling=on)
    args.update(kw)
    return LLMEngine(EngineArgs(**args))


@pytest.fixture(scope="module")
def pair(tiny_llama):
    return {on: _engine(tiny_llama, on) for on in (False, True)}


def _drive(eng: LLMEngine, requests: list[tuple[str, str, SamplingParams]],
           actions: dict[int, list[tuple[str, str]]] | None = None) -> tuple[dict, dict]:
    """Add `requests`, step to the end (running `actions[k]` -- ("abort"|"pause"|"resume", id)
    -- after the k-th step), and return {id: [(token ids, text, finish, stop_reason) per sample]}
    plus, per request, every snapshot the steps streamed of it, in order (when a step
    happens to admit a request may differ with overlap; what its stream shows may not)."""
    for rid, prompt, params in requests:
        eng.add_request(rid, prompt, params)
    final, trace, k = {}, {}, 0
    actions = actions or {}
    while eng.has_unfinished_requests():
        outs = eng.step()
        k += 1
        assert k < 2000, "the engine does not finish"
        for o in outs:
            trace.setdefault(o.request_id, []).append((tuple(tuple(c.token_ids) for c in o.outputs), o.finished))
        for o in outs:
            final[o.request_id] = [(list(c.token_ids), c.text, c.finish_reason, c.stop_reason) for c in o.outputs]
        for verb, rid in actions.get(k, []):
            {"abort": eng.abort_request, "pause": eng.pause_request, "resume": eng.resume_request}[verb](rid)
    assert eng.kv.pool.num_used == 0, "KV blocks left allocated"
    assert not eng.scheduler.has_unfinished() and not eng.scheduler.requests
    return final, trace


def _greedy(max_tokens: int = 24, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_same_tokens_and_finish_reasons_across_stop_rules(pair):
    seeded = dict(n=3, temperature=1.0, seed=5, max_tokens=18, ignore_eos=True)
    plain = [(f"r{i}", p, _greedy(24 + i, ignore_eos=True)) for i, p in enumerate(PROMPTS)]
    ref, _ = _drive(pair[False], plain + [("n3", PROMPTS[7], SamplingParams(**seeded))])
    # sample 0 of an n=3 request stops by its 11th token; its siblings carry on (or stop elsewhere)
    n3_stop = ref["n3"][0][0][10]
    texts = {rid: ref[rid][0][1] for rid, _, _ in plain}
    toks = {rid: ref[rid][0][0] for rid, _, _ in plain}
    # a stop string part-way through r0's text; a stop token part-way through r1's (EOS's path)
    cut = next(i for i in range(6, len(texts["r0"]) - 2) if texts["r0"].find(texts["r0"][i:i + 2]) == i)
    stop = texts["r0"][cut:cut + 2]
    mixed = [
        ("r0", PROMPTS[0], _greedy(24, stop=[stop])),
        ("r1", PROMPTS[1], _greedy(25, stop_token_ids=[toks["r1"][6]])),
        ("r2", PROMPTS[2], _greedy(1)),
        ("r3", PROMPTS[3], _greedy(3)),
        ("r4", PROMPTS[4], _greedy(28, ignore_eos=True, logprobs=2)),
        ("r5", PROMPTS[5], _greedy(6, repetition_penalty=1.3, min_tokens=4)),
        ("r6", PROMPTS[6], _greedy(12, stop=[texts["r6"][3:5]], include_stop_str_in_output=True)),
        ("r7", PROMPTS[7], SamplingParams(**{**seeded, "ignore_eos": False, "stop_token_ids": [n3_stop]})),
        ("r8", PROMPTS[0], _greedy(9, ignore_eos=True)),  # r0's prompt again: a prefix-cache hit
    ]
    off, trace_off = _drive(pair[False], mixed)
    before = pair[True].num_steps_ahead
    on, trace_on = _drive(pair[True], mixed)
    assert pair[True].num_steps_ahead > before  # the overlapped path ran
    assert on == off
    assert trace_on == trace_off  # each request streamed the same snapshots: nothing extra
    assert off["r0"][0][2] == "stop" and off["r0"][0][3] == stop and off["r1"][0][2] == "stop"
    assert len(off["r2"][0][0]) == 1 and off["r3"][0][2] == "length"
    ends = [len(c[0]) for c in off["r7"]]
    assert ends[0] <= 11 and max(ends) > ends[0], ends  # the siblings end at different steps


def test_logprobs_match(pair):
    reqs = [(f"lp{i}", p, _greedy(10, ignore_eos=True, logprobs=3)) for i, p in enumerate(PROMPTS[:4])]
    outs = {}
    for on in (False, True):
        for rid, prompt, params in reqs:
            pair[on].add_request(rid, prompt, params)
        got = {}
        while pair[on].has_unfinished_requests():
            for o in pair[on].step():
                if o.finished:
                    got[o.request_id] = [[(t, round(lp.logprob, 4)) for d in o.outputs[0].logprobs
                                          for t, lp in sorted(d.items())]]
        outs[on] = got
    assert outs[True] == outs[False]


def test_aborts_and_pauses_mid_stream(pair):
    ref, _ = _drive(pair[False], [("t", PROMPTS[5], _greedy(14, ignore_eos=True))])
    toks = ref["t"][0][0]
    k = next(i for i in range(6, 14) if toks[i] not in toks[:i])
    reqs = [(f"a{i}", p, _greedy(30, ignore_eos=True)) for i, p in enumerate(PROMPTS[:5])]
    # a5 is paused after its k-th token; with overlap its next one (a stop token) was already
    # launched, so it ends while paused
    reqs.append(("a5", PROMPTS[5], _greedy(30, stop_token_ids=[toks[k]])))
    actions = {4: [("abort", "a1")], 7: [("pause", "a3"), ("abort", "a4")], 11: [("resume", "a3")],
               13: [("abort", "a2")]}
    actions.setdefault(k, []).append(("pause", "a5"))
    actions.setdefault(k + 3, []).append(("resume", "a5"))
    off, _ = _drive(pair[False], reqs, actions)
    on, _ = _drive(pair[True], reqs, actions)
    # a paused request may get the token of the step already launched for it: the stream's
    # timing differs, its tokens do not
    assert on == off
    # an abort ends a request with no output of its own: what was streamed before it stays
    assert len(on["a1"][0][0]) == 4 and len(on["a2"][0][0]) < 30 and on["a1"][0][2] is None
    assert on["a3"][0][2] == "length" and len(on["a3"][0][0]) == 30
    assert on["a5"][0][2] == "stop" and on["a5"][0][0] == toks[:k + 1]


def test_structured_output_is_unchanged(pair):
    so = StructuredOutputsParams(regex="[a-c]{3,12}x")
    reqs = [("g0", PROMPTS[0], _greedy(20, structured_outputs=so)),
            ("g1", PROMPTS[1], SamplingParams(temperature=1.0, seed=3, max_tokens=20, structured_outputs=so)),
            ("p0", PROMPTS[2], _greedy(20, ignore_eos=True))]
    off, _ = _drive(pair[False], reqs)
    on, _ = _drive(pair[True], reqs)
    assert on == off
    assert off["g0"][0][1].endswith("x") and off["g0"][0][2] == "stop"


def test_preemption_with_few_kv_blocks(tiny_llama):
    reqs = [(f"p{i}", p * 2, _greedy(40, ignore_eos=True)) for i, p in enumerate(PROMPTS[:6])]
    reqs.append(("s", PROMPTS[6], _greedy(40, stop=["\n\n\n"])))
    got = {}
    for on in (False, True):
        eng = _engine(tiny_llama, on, max_model_len=96, num_kv_blocks=14)
        got[on], _ = _drive(eng, reqs)
        assert eng.scheduler.num_preemptions > 0
        if on:
            assert eng.num_steps_ahead > 0
    assert got[True] == got[False]


def test_server_streams_with_async_scheduling(tiny_llama):
    from tokenloom.bench.launcher import free_port

    server = ThreadedServer([str(tiny_llama), "--port", str(free_port()), "--max-model-len", "128",
                             "--num-kv-blocks", "64", "--async-scheduling", "--log-level", "warning",
                             "--disable-access-log"]).start()
    try:
        body = dict(model=str(tiny_llama), prompt=PROMPTS[0], max_tokens=16, temperature=0)
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            whole = c.post("/v1/completions", json=body).json()["choices"][0]
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                events = sse_events(r.iter_lines())
            cut = whole["text"][4:6]
            stopped = c.post("/v1/completions", json={**body, "stop": [cut]}).json()["choices"][0]
        chunks = [e for e in events if isinstance(e, dict)]
        assert "".join(ch["choices"][0]["text"] for ch in chunks) == whole["text"]
        assert chunks[-1]["choices"][0]["finish_reason"] == whole["finish_reason"] == "length"
        assert stopped["text"] == whole["text"][:whole["text"].find(cut)] and stopped["finish_reason"] == "stop"
        engine = server.engine.engine
        assert engine.async_scheduling and engine.num_steps_ahead > 0
        assert engine.kv.pool.num_used == 0
    finally:
        server.stop()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU captures the real graphs (the other tests use them)")
def test_graph_buffers_take_the_ids_from_the_device(tiny_llama):
    """The decode-graph path (its padded buffers, run eagerly here: there is no GPU) with the
    step ahead's ids copied from the previous step's sampled tokens into the graph's input."""
    got, fed = {}, []
    reqs = [(f"d{i}", p, _greedy(12, ignore_eos=True)) for i, p in enumerate(PROMPTS[:3])]
    for on in (False, True):
        eng = _engine(tiny_llama, on, attention_backend="triton", enforce_eager=True, device="cpu")
        eng.runner.graphs = graphs = eng.runner.make_decode_graphs(max_num_seqs=4)
        run = graphs.run
        graphs.run = lambda *a: fed.append(on and a[4] is not None) or run(*a)
        got[on], _ = _drive(eng, reqs)
    assert got[True] == got[False]
    assert any(fed)  # some steps' ids came from the device


def test_beam_search_alongside_sampling_is_unchanged(pair):
    """Beams take their tokens from the beam search after each step: no step runs ahead while
    one is in the batch, and both the beams and the plain requests beside them are unchanged."""
    from tokenloom.sampling_params import BeamSearchParams

    reqs = [("b", PROMPTS[1], BeamSearchParams(beam_width=3, max_tokens=6, ignore_eos=True)),
            ("s0", PROMPTS[2], _greedy(10, ignore_eos=True)), ("s1", PROMPTS[3], _greedy(16, ignore_eos=True))]
    off, _ = _drive(pair[False], reqs)
    on, _ = _drive(pair[True], reqs)
    assert on == off and len(off["b"]) == 3
