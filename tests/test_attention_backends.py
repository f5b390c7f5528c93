"""Every attention backend gives transformers' greedy tokens on the same weights.

The Triton kernels run here on CPU tensors under Triton's interpreter (TRITON_INTERPRET=1,
set by conftest.py where there is no GPU), so the GPU path's kernels — paged decode and
prefill reading blocks in place, the KV write, the fused norms, rotary and SwiGLU — are
checked in CI against transformers under chunked prefill, tiny blocks and preemption."""

from __future__ import annotations

import pytest
import torch

from tokenloom import LLM, SamplingParams

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
