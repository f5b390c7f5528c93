"""The decode path that CUDA graphs capture, checked on the CPU.

On a GPU, decode-only steps replay one CUDA graph per padded batch size
(runner/cuda_graphs.py).  What makes that correct is testable without one: the same
padded forward over the same persistent buffers runs eagerly here (Triton kernels under
the interpreter), so padding rows must leave the real rows' logits and the KV cache as
they are, and the forward must never synchronise with the host."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tokenloom import LLM, SamplingParams
from tokenloom.runner.cuda_graphs import capture_sizes

from test_parity import STRESS, _hf, _hf_greedy, _prompts
from test_spec_decode import SPEC, hf_checkpoint  # noqa: F401 (a fixture)
from test_spec_decode import _prompts as _spec_prompts


def test_capture_sizes():
    assert capture_sizes(256) == [1, 2, 4, *range(8, 257, 8)]
    assert capture_sizes(1000) == capture_sizes(256)
    assert capture_sizes(12) == [1, 2, 4, 8, 16]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(1) == [1]


CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


def _triton_llm(path, **kw):
    """The triton backend, eager (the padded forward is called directly where graphs would be)."""
    return LLM(str(path), device=DEVICE, attention_backend="triton", enforce_eager=True, **kw)


def test_padded_decode_graph_path_verifies_drafts(hf_checkpoint):
    """Speculative decoding's verifying steps (1 + k decode rows a request) through the padded
    buffers, as a GPU replays them from the graph of their row count: the same greedy tokens
    as without speculation, drafts accepted and rejected, every block returned."""
    prompts = [{"prompt_token_ids": p} for p in _spec_prompts()[:3]]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    kw = dict(max_model_len=200, num_kv_blocks=100)
    ref = [o.outputs[0].token_ids for o in _triton_llm(hf_checkpoint, **kw).generate(prompts, sp, use_tqdm=False)]
    events = []
    llm = _triton_llm(hf_checkpoint, observers=[events.append], speculative_config={**SPEC, "disable_by_batch_size": 8},
                      **kw)
    runner = llm.llm_engine.runner
    runner.graphs = runner.make_decode_graphs(max_num_seqs=16)
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: used.append(len(a[0])) or run(*a)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(used) > len(prompts)  # steps of more rows than requests: verifying steps
    accepted = sum(e.num_accepted_tokens for e in events)
    assert 0 < accepted < sum(e.num_draft_tokens for e in events)
    assert llm.llm_engine.kv.pool.num_free == 100


def test_padded_decode_graph_path_gives_transformers_tokens(model_factory):
    """Every decode-only step through the padded buffers (sizes 1, 2, 4: three requests
    pad to four), with chunked prefill and preemption around them."""
    path = model_factory("tiny-llama")
    prompts = _prompts()[:3]
    ref = _hf_greedy(_hf(path), prompts, 10)
    llm = _triton_llm(path, **STRESS)
    runner = llm.llm_engine.runner
    assert runner.graphs is None and runner.graphs_off_reason in ("not on a CUDA device", "--enforce-eager")
    runner.graphs = runner.make_decode_graphs(max_num_seqs=3)
    used = []
    run = runner.graphs.run
    runner.graphs.run = lambda *a: used.append(len(a[0])) or run(*a)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert 3 in used  # three decodes padded to a batch of four
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]


def _decode_batch(llm, n: int):
    """Step the engine until n requests are all decoding; schedule the next (decode-only)
    step and return its rows' inputs, blocks allocated by the scheduler."""
    eng = llm.llm_engine
    for i, p in enumerate(_prompts()[:n]):
        eng.add_request(str(i), {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(20):
        eng.step()
        running = eng.scheduler.running
        if len(running) == n and all(r.num_computed_tokens >= r.num_prompt_tokens for r in running):
            break
    out = eng.scheduler.schedule()
    assert len(out.scheduled) == n and all(s.phase == "decode" for s in out.scheduled)
    ids, pos, slots, _ = eng.runner._decode_inputs(out.scheduled, eng.runner.block_size)
    return ids, pos, slots, [s.block_ids for s in out.scheduled]


def test_padding_rows_change_neither_real_logits_nor_the_cache(model_factory):
    llm = _triton_llm(model_factory("tiny-qwen3"), block_size=4, max_model_len=100)
    runner = llm.llm_engine.runner
    ids, pos, slots, blocks = _decode_batch(llm, 3)
    graphs = runner.make_decode_graphs(max_num_seqs=8)
    before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    graphs.load(3, ids, pos, slots, blocks)
    exact = graphs.forward(3).clone()  # no padding
    after_exact = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for b in (4, 8):
        for (k, v), (k0, v0) in zip(runner.kv_caches, before):
            k.copy_(k0), v.copy_(v0)
        graphs.load(b, ids, pos, slots, blocks)
        assert graphs.slots[3:b].eq(-1).all() and graphs.lens[3:b].eq(0).all()
        padded = graphs.forward(b)
        torch.testing.assert_close(padded[:3], exact, rtol=0, atol=1e-5)
        for (k, v), (k1, v1) in zip(runner.kv_caches, after_exact):
            for x, x1 in ((k.flatten(0, 1), k1.flatten(0, 1)), (v.flatten(0, 1), v1.flatten(0, 1))):
                # the real rows' slots within a GEMM's rounding (a batch of b rows, not 3) ...
                torch.testing.assert_close(x[slots], x1[slots], rtol=0, atol=1e-5)
                others = torch.ones(x.shape[0], dtype=torch.bool)
                others[slots] = False
                assert torch.equal(x[others], x1[others])  # ... and padding wrote nowhere


@contextlib.contextmanager
def _no_host_sync():
    """Make every way a tensor's value reaches Python raise."""
    def refuse(*_a, **_k):
        raise AssertionError("host synchronisation inside the decode forward")
    saved = {n: getattr(torch.Tensor, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__")}
    for n in saved:
        setattr(torch.Tensor, n, refuse)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.Tensor, n, f)


def test_decode_forward_never_synchronises_with_the_host(model_factory):
    llm = _triton_llm(model_factory("tiny-llama"), block_size=4, max_model_len=100)
    runner = llm.llm_engine.runner
    ids, pos, slots, blocks = _decode_batch(llm, 2)
    graphs = runner.make_decode_graphs(max_num_seqs=4)
    graphs.load(2, ids, pos, slots, blocks)
    with _no_host_sync():
        with pytest.raises(AssertionError):
            torch.ones(1).item()  # the guard is live
        graphs.forward(2)


@pytest.mark.skipif(not CUDA, reason="captures real CUDA graphs")
def test_captured_graphs_give_transformers_tokens(model_factory):
    path = model_factory("tiny-qwen2")
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, 16)
    llm = LLM(str(path), device="cuda", max_num_seqs=8, max_model_len=128)
    graphs = llm.llm_engine.runner.graphs
    assert graphs is not None and sorted(graphs.graphs) == [1, 2, 4, 8]
    replays = []
    run = graphs.run
    graphs.run = lambda *a: replays.append(len(a[0])) or run(*a)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert replays


@pytest.mark.skipif(not CUDA, reason="captures real CUDA graphs")
def test_captured_graphs_replay_verifying_steps(hf_checkpoint):
    prompts = [{"prompt_token_ids": p} for p in _spec_prompts()[:3]]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = dict(device="cuda", max_num_seqs=16, max_model_len=200)
    ref = [o.outputs[0].token_ids for o in LLM(str(hf_checkpoint), **kw).generate(prompts, sp, use_tqdm=False)]
    llm = LLM(str(hf_checkpoint), speculative_config={**SPEC, "disable_by_batch_size": 8}, **kw)
    graphs = llm.llm_engine.runner.graphs
    replays = []
    run = graphs.run
    graphs.run = lambda *a, **k: replays.append(len(a[0])) or run(*a, **k)
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert max(replays) > len(prompts)  # verifying steps replayed the graph of their row count
