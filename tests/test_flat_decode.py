"""The flat decode loop (model/flat_decode.py) against the module path it stands in for.

Both call the same ops on the same tensors in the same order, so the claim is exact: the
same greedy tokens and bit-identical log-probabilities, on checkpoints saved by transformers
(Qwen2 with q/k/v bias and untied head, Llama with tied embeddings), in float32 and bfloat16,
through every linear kind the loop calls (our panels, oneDNN, int8 and int4), with decode
batches of several requests and speculative verifying steps.  Which steps took the flat
loop is counted, so a loop that never ran cannot pass.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_checkpoints import TINY, _save_checkpoint
from test_parity import _prompts
from test_spec_decode import SPEC, STRESS, hf_checkpoint  # noqa: F401 (a fixture)
from test_spec_decode import _prompts as _spec_prompts
from transformers import LlamaConfig, Qwen2Config

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.flat_decode import FlatDecode

CONFIGS = {
    "qwen2-bias-untied": lambda: Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1e6),
    "llama-tied": lambda: LlamaConfig(**TINY, tie_word_embeddings=True, rope_theta=1e4),
}
# no prefix cache: the second run of the same prompts must prefill exactly as the first did
ENGINE = dict(block_size=4, max_num_batched_tokens=12, num_kv_blocks=200, max_model_len=128, enable_prefix_caching=False)
CASES = [  # (dtype, quantization, linear backend)
    ("float32", None, "panels"),
    ("float32", None, "onednn"),
    ("bfloat16", None, "auto"),
    ("bfloat16", "int8", "auto"),
    ("float32", "int4", "auto"),
]

pytestmark = pytest.mark.skipif(not cpu_kernels.fused_enabled() or not cpu_kernels.attention_enabled(),
                                reason="the flat loop runs our CPU ops, which do not build here")


def _model(llm: LLM):
    return llm.llm_engine.runner.model


def _generate(llm: LLM, prompts, **sp):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=4, **sp), use_tqdm=False)
    return [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.outputs[0].logprobs])
            for o in outs]


def _counting(flat: FlatDecode) -> list[int]:
    """The row count of every step `flat` runs (its forward still does the work)."""
    rows: list[int] = []
    run = flat.forward

    def counted(input_ids, *args):
        rows.append(input_ids.shape[0])
        return run(input_ids, *args)

    flat.forward = counted
    return rows


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype,quantization,linear", CASES)
def test_flat_loop_gives_the_module_paths_tokens_and_logprobs_exactly(tmp_path, config, dtype, quantization, linear):
    if quantization and cpu_kernels.quant_ops() is None:
        pytest.skip("our quantized kernel does not build here")
    if linear == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    path = _save_checkpoint(CONFIGS[config](), tmp_path)
    llm = LLM(str(path), dtype=dtype, quantization=quantization, linear_backend=linear, **ENGINE)
    model = _model(llm)
    assert model.flat is not None, "the flat loop should apply to a CPU model with our ops"
    rows = _counting(model.flat)
    prompts = _prompts()[:4]  # several requests decode together
    flat = _generate(llm, prompts)
    assert len(rows) >= 9 and max(rows) == len(prompts)  # the decode steps (prefill steps are not decode-only)
    model.flat = None
    assert _generate(llm, prompts) == flat


def test_speculative_verifying_steps_take_the_flat_loop(hf_checkpoint):
    """Verifying steps are decode rows of several tokens per request: the flat loop runs them,
    and greedy output matches the module path's without speculation."""
    prompts = [{"prompt_token_ids": p} for p in _spec_prompts()]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(str(hf_checkpoint), speculative_config={**SPEC, "disable_by_batch_size": 8}, **STRESS)
    rows = _counting(_model(llm).flat)
    with_flat = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    assert max(rows) > len(prompts)  # a step verified drafts: more rows than requests
    plain = LLM(str(hf_checkpoint), **STRESS)
    _model(plain).flat = None
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)] == with_flat


def test_steps_the_loop_cannot_run_keep_the_module_path(tmp_path):
    """The reference ops backend builds no flat loop; nor does SDPA attention (the backend plan says so)."""
    path = _save_checkpoint(CONFIGS["llama-tied"](), tmp_path)
    assert _model(LLM(str(path), ops_backend="torch", **ENGINE)).flat is None
    llm = LLM(str(path), attention_backend="sdpa", **ENGINE)
    assert not llm.llm_engine.backends.flat_decode and _model(llm).flat is None  # the plan decided it
    assert _generate(llm, _prompts()[:2])
