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
