"""Flat calls (model/layers.py `bound_linear`) against module calls: one forward, two bindings.

The model has one layer loop (model/llama.py `LayerStep`); the backend plan binds each
layer's linears either as plain functions (no nn.Module dispatch: the fast CPU decode
path) or through their modules (what torch.compile traces).  Both call the same ops on the
same tensors in the same order, so the claim is exact: the same greedy tokens and
bit-identical log-probabilities, on checkpoints saved by transformers (Qwen2 with q/k/v bias
and untied head, Llama with tied embeddings), in float32 and bfloat16, through every linear
kind (our panels, oneDNN, int8 and int4), with decode batches of several requests and
speculative verifying steps.  Which steps went through the plain functions is counted, so
a binding that never ran cannot pass.
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


def _counting(llm: LLM) -> list[int]:
    """The row count of every step through layer 0's qkv linear, as bound now (the
    function still does the work)."""
    rows: list[int] = []
    step = _model(llm).steps[0]
    run = step.qkv

    def counted(x):
        rows.append(x.shape[0])
        return run(x)

    step.qkv = counted
    return rows


def _bind_modules(llm: LLM) -> None:
    """The same engine, every layer's linears called through their modules."""
    runner = llm.llm_engine.runner
    runner.model.bind(runner.ops, runner.attn, flat=False)
    assert isinstance(_model(llm).steps[0].qkv, torch.nn.Module)


@pytest.mark.parametrize("config", sorted(CONFIGS))
@pytest.mark.parametrize("dtype,quantization,linear", CASES)
def test_flat_calls_give_the_module_calls_tokens_and_logprobs_exactly(tmp_path, config, dtype, quantization, linear):
    if quantization and cpu_kernels.quant_ops() is None:
        pytest.skip("our quantized kernel does not build here")
    if linear == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("no oneDNN in this torch build")
    path = _save_checkpoint(CONFIGS[config](), tmp_path)
    llm = LLM(str(path), dtype=dtype, quantization=quantization, linear_backend=linear, **ENGINE)
    assert llm.llm_engine.backends.flat_calls and llm.llm_engine.backends.ops == "cpu"
    assert not isinstance(_model(llm).steps[0].qkv, torch.nn.Module), "flat: linears as plain functions"
    rows = _counting(llm)
    prompts = _prompts()[:4]  # several requests decode together
    flat = _generate(llm, prompts)
    assert len(rows) >= 10 and len(prompts) in rows  # every step, decode steps of the four requests among them
    _bind_modules(llm)
    assert _generate(llm, prompts) == flat


def test_speculative_verifying_steps_take_the_flat_calls(hf_checkpoint):
    """Verifying steps are decode rows of several tokens per request: the flat calls run them,
    and greedy output matches module calls' without speculation."""
    prompts = [{"prompt_token_ids": p} for p in _spec_prompts()]
    sp = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    llm = LLM(str(hf_checkpoint), speculative_config={**SPEC, "disable_by_batch_size": 8}, **STRESS)
    events = []
    llm.llm_engine.add_observer(events.append)
    assert not isinstance(_model(llm).steps[0].qkv, torch.nn.Module)
    with_flat = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    # a step verified drafts through the flat calls: more decode rows than requests
    assert any(e.entries and all(x.phase == "decode" for x in e.entries)
               and sum(x.num_tokens for x in e.entries) > len(e.entries) for e in events)
    plain = LLM(str(hf_checkpoint), **STRESS)
    _bind_modules(plain)
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)] == with_flat


def test_torch_compile_keeps_module_calls(tmp_path):
    """torch.compile traces the modules' custom ops, so the plan binds modules there; the
    reference ops backend still binds plain functions (the loop is the same either way)."""
    from tokenloom.model.backends import resolve_backends

    fields = dict(head_dim=16, qk_norm=False, sliding_window=None)
    assert not resolve_backends(torch.device("cpu"), torch.float32, fields, compile=True).flat_calls
    path = _save_checkpoint(CONFIGS["llama-tied"](), tmp_path)
    llm = LLM(str(path), ops_backend="torch", **ENGINE)
    assert llm.llm_engine.backends.flat_calls and _generate(llm, _prompts()[:2])
