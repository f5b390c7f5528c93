"""Every attention backend gives transformers' greedy tokens on the same weights.

The Triton kernels run here on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py where there is no GPU), so the GPU path's kernels — paged decode and
prefill reading blocks in place, the KV write, the fused norms, rotary and SwiGLU — are
checked in CI against transformers under chunked prefill, tiny blocks and preemption."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom import LLM, SamplingParams
from tokenloom.model.attention import GROUP_PADDING, AttentionBackend, LayerAttention, _causal_groups

from test_parity import STRESS, _hf, _hf_greedy, _prompts

NEW_TOKENS = 12


@pytest.mark.parametrize("backend", ["sdpa", "triton"])
@pytest.mark.parametrize("preset", ["tiny-llama", "tiny-qwen3"])
def test_backend_greedy_matches_transformers(model_factory, preset, backend):
    path = model_factory(preset)
    prompts = _prompts()
    ref = _hf_greedy(_hf(path), prompts, NEW_TOKENS)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    llm = LLM(str(path), device=device, attention_backend=backend, **STRESS)
    assert llm.llm_engine.runner.attn.name == backend
    assert f"attention backend {backend}" in llm.llm_engine.summary()  # named at start-up
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert llm.llm_engine.scheduler.num_preemptions > 0
    assert llm.llm_engine.kv.pool.num_free == STRESS["num_kv_blocks"]


@pytest.mark.parametrize("linear", ["panels", "onednn", "torch"])
def test_linear_backend_chosen_once_and_named(model_factory, linear):
    """`--linear-backend`: each way the matmuls run gives transformers' tokens, and the
    start-up summary names the one chosen."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.packed_linear import packing_supported

    if torch.cuda.is_available():
        pytest.skip("CPU linear backends")
    if linear == "panels" and not cpu_kernels.load() or linear == "onednn" and not packing_supported(
            torch.device("cpu"), torch.float32):
        pytest.skip(f"{linear} cannot run on this CPU")
    path = model_factory("tiny-qwen2")
    prompts = _prompts()[:3]
    llm = LLM(str(path), device="cpu", linear_backend=linear, max_model_len=128)
    assert f"linear backend {linear}" in llm.llm_engine.summary()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(_hf(path), prompts, NEW_TOKENS)


def test_a_backend_that_cannot_run_is_refused(model_factory):
    path = model_factory("tiny-llama")
    with pytest.raises(ValueError, match="linear-backend must be one of"):
        LLM(str(path), device="cpu", linear_backend="cublas", max_model_len=64)
    with pytest.raises(ValueError, match="ops-backend triton"):
        LLM(str(path), device="cpu", attention_backend="sdpa", ops_backend="triton", max_model_len=64)


@settings(max_examples=20, deadline=None)
@given(lens=st.lists(st.integers(1, 40) | st.integers(41, 160), min_size=1, max_size=5),
       block_size=st.sampled_from([1, 4, 16]), groups=st.sampled_from([1, 3]), seed=st.integers(0, 2**16))
def test_prefill_from_each_requests_first_token_is_causal_attention_over_its_own_keys(
        lens: list[int], block_size: int, groups: int, seed: int) -> None:
    """Chunks that start their requests (nothing cached) take SDPA's causal path, no mask:
    every real row equals float64 causal attention over its own request's keys (GQA, blocks
    scattered in the cache, requests of near-equal lengths padded to the longest, of unequal
    ones in length groups each padded to its own longest, of equal ones read in place)."""
    g = torch.Generator().manual_seed(seed)
    hk, d = 2, 16
    hq = hk * groups
    nb = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(nb) + 3, generator=g)[:sum(nb)] + 1  # block 0 pads the tables
    k_cache = torch.randn(sum(nb) + 4, block_size, hk, d, generator=g)
    v_cache = torch.randn(sum(nb) + 4, block_size, hk, d, generator=g)
    tables = torch.zeros(len(lens), max(nb), dtype=torch.long)
    for i, (a, b) in enumerate(zip([sum(nb[:i]) for i in range(len(nb))], nb)):
        tables[i, :b] = ids[a:a + b]
    starts = torch.tensor([sum(lens[:i]) for i in range(len(lens))])
    q = torch.randn(sum(lens), hq, d, generator=g)
    backend = AttentionBackend()
    meta = backend.metadata(torch.arange(sum(lens)), torch.device("cpu"), block_size, prefill_block_tables=tables,
                            prefill_q_starts=starts, prefill_q_lens=torch.tensor(lens),
                            prefill_ctx_lens=torch.zeros(len(lens), dtype=torch.long))
    assert meta.prefill_from_zero and not meta.prefill_masks
    assert meta.prefill_dense == (len(set(lens)) == 1)  # equal chunks: a view of the rows, no gather
    split = _causal_groups(lens)
    assert sorted(i for g in split for i in g) == list(range(len(lens)))  # each chunk in one group
    assert all(lens[g[0]] ** 2 - lens[i] ** 2 <= max(GROUP_PADDING, lens[g[0]] ** 2 // 4) for g in split for i in g)
    assert len(meta.prefill_groups) == (len(split) if len(split) > 1 else 0)
    out = torch.zeros_like(q)
    backend.prefill(q, k_cache, v_cache, meta, d ** -0.5, out, LayerAttention())
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].reshape(-1, hk, d)[:n].double().repeat_interleave(groups, dim=1)  # [n, Hq, d]
        v = v_cache[tables[i]].reshape(-1, hk, d)[:n].double().repeat_interleave(groups, dim=1)
        qi = q[starts[i]:starts[i] + n].double()
        s = torch.einsum("qhd,khd->hqk", qi, k) * d ** -0.5
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool).triu(1), float("-inf"))
        ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
        torch.testing.assert_close(out[starts[i]:starts[i] + n].double(), ref, rtol=0, atol=1e-5)


def test_prefill_in_length_groups_matches_transformers(model_factory):
    """Prompts far apart in length prefilled in one step: SDPA per length group (each padded
    to its own longest, `_causal_groups`), the rows put back in token order, give
    transformers' greedy tokens."""
    lens = [150, 5, 110, 62, 111]
    assert _causal_groups(lens) == [[0], [4, 2], [3, 1]]  # 150 | 111, 110 | 62, 5
    path = model_factory("tiny-llama")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lens]
    llm = LLM(str(path), device="cpu", max_model_len=256, max_num_batched_tokens=1024)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(_hf(path), prompts, NEW_TOKENS)


def test_bf16_prefill_on_tiles_matches_transformers(model_factory, monkeypatch):
    """bfloat16 prompts far apart in length prefilled in one step through the tile kernel
    (`causal_prefill_attention`, where AMX runs; head size 32, 7 query heads per KV head as
    Qwen2.5-0.5B): each prompt's next-token logprobs stay within bf16's reach of transformers'
    bf16 forward."""
    from tokenloom.kernels import amx

    if amx.prefill_attention_op(torch.device("cpu"), torch.bfloat16, 32) is None:
        pytest.skip("no usable AMX here: prefills take SDPA")
    # weights scaled for the wider layers (the tiny presets' 0.25 at 448 features makes each
    # linear a 5x gain, and bf16's rounding alone then moves a logprob by ~0.8)
    path = model_factory("tiny-qwen2", init_std=0.1, overrides={"hidden_size": 448, "num_attention_heads": 14,
                                                                "num_key_value_heads": 2, "intermediate_size": 256})
    lens = [150, 5, 110, 62, 111]
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(5, 1000, (n,), generator=g).tolist() for n in lens]
    llm = LLM(str(path), dtype="bfloat16", max_model_len=256, max_num_batched_tokens=1024)
    calls = []
    backend = llm.llm_engine.runner.attn
    op = backend.prefill_op
    monkeypatch.setattr(backend, "prefill_op", lambda *a: calls.append(a[5].numel()) or op(*a))
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=1, logprobs=5), use_tqdm=False)
    assert calls and calls[0] == len(lens)  # one step, every prompt a chunk of the kernel's
    hf16 = _hf(path, torch.bfloat16)
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf16(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - ref[tok].item()) < 0.1  # bf16: ~3 significant digits


def test_length_groups_stay_few_for_many_distinct_lengths():
    """A step of many prompts, every length different: a few padded calls (each chunk padded by
    at most a quarter of its group's longest rows^2 beyond GROUP_PADDING), not one per prompt."""
    lens = list(range(100, 612, 2))  # 256 distinct lengths
    split = _causal_groups(lens)
    # each group's longest is under sqrt(3/4) of the one before: at most 1 + log_{sqrt(4/3)}(610 / 100)
    assert len(split) <= 1 + math.log(610 / 100) / math.log(math.sqrt(4 / 3))
    assert all(lens[g[0]] ** 2 - lens[i] ** 2 <= max(GROUP_PADDING, lens[g[0]] ** 2 // 4) for g in split for i in g)
    assert _causal_groups([64, 90, 64]) == [[1, 0, 2]]  # under GROUP_PADDING: one call
