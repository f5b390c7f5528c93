"""Checkpoints that transformers itself writes load with transformers' meaning.

Two halves.  First, `model/hf_config.py` against the installed transformers, field by
field, on config.json dicts in both the 4.x format (top-level `rope_theta`, `rope_scaling`)
and the 5.x one (`rope_parameters`), with keys left out so each family's own defaults
apply: what a transformers model built from the same dict *has* (bias tensors, q/k norms,
tied head, per-layer window, rotary inv_freq and cos/sin scale) is what we read.  Second,
tiny models built with transformers' own config classes and saved with `save_pretrained`
(never a config we wrote) generate with tokenloom exactly the greedy tokens transformers
generates, with first-token log-probabilities within 1e-4, under chunked prefill.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from test_parity import _hf, _hf_greedy, _prompts
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from tokenloom import LLM, SamplingParams
from tokenloom.model.hf_config import model_args_fields
from tokenloom.model.rope_scaling import rope_inv_freq
from tokenloom.model.tools.tokenizer_builder import default_tokenizer, save_hf_tokenizer

TRANSFORMERS_5 = int(transformers.__version__.split(".")[0]) >= 5
# Configs in the 5.x format mean nothing to transformers 4, which ignores `rope_parameters`.
NEEDS_5 = pytest.mark.skipif(not TRANSFORMERS_5, reason="transformers < 5 does not read rope_parameters")
ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
        "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=1024, max_position_embeddings=512)
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


# ---- config.json -> ModelArgs, against transformers' own reading ----------------------------

def _what_transformers_builds(cfg: dict) -> dict:
    """The ModelArgs fields, read off the model transformers builds from `cfg` (on the meta
    device: structure only) and off its rotary module (on the CPU: the real tables)."""
    hf_cfg = AutoConfig.for_model(**cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    inner = model.model
    attn, mlp = inner.layers[0].self_attn, inner.layers[0].mlp
    if cfg["model_type"] == "mistral":
        windows = [hf_cfg.sliding_window] * len(inner.layers)  # MistralAttention reads the config's window
    elif cfg["model_type"] == "llama":
        windows = [None] * len(inner.layers)
    else:
        windows = [layer.self_attn.sliding_window for layer in inner.layers]
    rotary = type(inner.rotary_emb)(config=hf_cfg)
    return dict(
        vocab_size=inner.embed_tokens.num_embeddings,
        hidden_size=inner.embed_tokens.embedding_dim,
        intermediate_size=mlp.gate_proj.out_features,
        num_layers=len(inner.layers),
        num_heads=attn.q_proj.out_features // attn.head_dim,
        num_kv_heads=attn.k_proj.out_features // attn.head_dim,
        head_dim=attn.head_dim,
        rms_norm_eps=inner.norm.variance_epsilon,
        max_position_embeddings=hf_cfg.max_position_embeddings,
        tie_word_embeddings=model.lm_head.weight is inner.embed_tokens.weight,
        qkv_bias=attn.q_proj.bias is not None,
        o_bias=attn.o_proj.bias is not None,
        mlp_bias=mlp.gate_proj.bias is not None,
        qk_norm=hasattr(attn, "q_norm"),
        layer_windows=tuple(windows),
        inv_freq=rotary.inv_freq,
        attention_scaling=rotary.attention_scaling,
    )


def _cfg(model_type: str, **kw) -> dict:
    return {"model_type": model_type, "architectures": [ARCH[model_type]], **kw}


# Each case: a config.json dict as a checkpoint may hold it.
CONFIG_CASES = {
    "llama-v4-llama3": _cfg("llama", **TINY, rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3}),
    "llama-v5-llama3": _cfg("llama", **TINY, rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3}),
    "llama-v4-type-linear": _cfg("llama", **TINY, rope_theta=20000.0, rope_scaling={"type": "linear", "factor": 2.0}),
    "llama-v5-linear": _cfg("llama", **TINY, rope_parameters={"rope_type": "linear", "rope_theta": 20000.0,
                                                               "factor": 4.0}),
    "llama-v4-dynamic": _cfg("llama", **TINY, rope_scaling={"type": "dynamic", "factor": 2.0}),
    "llama-no-rope-keys": _cfg("llama", **TINY),
    "llama-theta-in-both-places": _cfg("llama", **TINY, rope_theta=1.0e4,
                                       rope_parameters={"rope_type": "default", "rope_theta": 3.0e5}),
    "llama-llama3-top-level-original-len": _cfg("llama", **TINY, original_max_position_embeddings=128,
                                                rope_parameters={"rope_type": "llama3", "rope_theta": 5e5,
                                                                 **{k: v for k, v in LLAMA3.items()
                                                                    if k != "original_max_position_embeddings"}}),
    "llama-biases-head-dim": _cfg("llama", **{**TINY, "head_dim": 32}, attention_bias=True, mlp_bias=True,
                                  tie_word_embeddings=True),
    "llama-minimal": _cfg("llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=1, intermediate_size=32,
                          vocab_size=64),
    "mistral-window-key-absent": _cfg("mistral", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                                      intermediate_size=32, vocab_size=64),
    "mistral-window-null": _cfg("mistral", **TINY, sliding_window=None, rope_theta=1e6),
    "mistral-window-8-v5": _cfg("mistral", **TINY, sliding_window=8,
                                rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
    "qwen2-v4-yarn": _cfg("qwen2", **TINY, rope_theta=1e6, tie_word_embeddings=True,
                          rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
    "qwen2-v5-yarn-attention-factor": _cfg("qwen2", **TINY, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "original_max_position_embeddings": 256,
        "attention_factor": 1.2, "beta_fast": 16, "beta_slow": 2}),
    "qwen2-v5-yarn-mscale": _cfg("qwen2", **TINY, rope_parameters={
        "rope_type": "yarn", "rope_theta": 1e4, "factor": 8.0, "original_max_position_embeddings": 64,
        "mscale": 0.8, "mscale_all_dim": 0.6, "truncate": False}),
    "qwen2-window-switched-off": _cfg("qwen2", **TINY, use_sliding_window=False, sliding_window=16,
                                      max_window_layers=0),
    "qwen2-window-on-every-layer": _cfg("qwen2", **TINY, use_sliding_window=True, sliding_window=16,
                                        max_window_layers=0),
    "qwen2-window-on-no-layer": _cfg("qwen2", **TINY, use_sliding_window=True, sliding_window=16,
                                     max_window_layers=2),
    "qwen2-window-on-upper-layers": _cfg("qwen2", **TINY, use_sliding_window=True, sliding_window=16,
                                         max_window_layers=1),
    "qwen2-layer-types-given": _cfg("qwen2", **TINY, use_sliding_window=True, sliding_window=16, max_window_layers=2,
                                    layer_types=["sliding_attention", "sliding_attention"]),
    "qwen2-defaults": _cfg("qwen2", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                           intermediate_size=32, vocab_size=64),
    "qwen3-head-dim-absent": _cfg("qwen3", hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                  num_hidden_layers=2, intermediate_size=32, vocab_size=64, rope_theta=1e6),
    "qwen3-v5-attention-bias": _cfg("qwen3", **{**TINY, "head_dim": 32}, attention_bias=True,
                                    rope_parameters={"rope_type": "default", "rope_theta": 1e6}),
}


@pytest.mark.parametrize("case", [pytest.param(c, marks=NEEDS_5) if "rope_parameters" in CONFIG_CASES[c] else c
                                  for c in sorted(CONFIG_CASES)])
def test_config_fields_match_what_transformers_builds(case):
    cfg = CONFIG_CASES[case]
    ours = model_args_fields(json.loads(json.dumps(cfg)), cfg["architectures"][0])
    ref = _what_transformers_builds(json.loads(json.dumps(cfg)))
    inv_freq, scale = rope_inv_freq(ours["head_dim"], ours["rope_theta"], ours["rope_scaling"],
                                    ours["max_position_embeddings"])
    assert torch.equal(inv_freq, ref.pop("inv_freq")), "rotary frequencies differ"
    assert scale == pytest.approx(ref.pop("attention_scaling"), rel=1e-12)
    ours["layer_windows"] = tuple(ours["sliding_window"] if t == "sliding_attention" else None
                                  for t in ours["layer_types"])
    assert {k: ours[k] for k in ref} == ref


@NEEDS_5
@pytest.mark.parametrize("model_type", sorted(ARCH))
def test_config_that_transformers_saves_reads_the_same_as_the_dict_it_came_from(tmp_path, model_type):
    """What transformers 5 writes (`rope_parameters`, `layer_types`, `dtype`) reads as the 4.x
    dict it was made from."""
    old = _cfg(model_type, **TINY, rope_theta=250000.0)
    if model_type == "llama":
        old["rope_scaling"] = {"rope_type": "llama3", **LLAMA3}
    AutoConfig.for_model(**old).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert "rope_parameters" in saved and "rope_theta" not in saved  # the new format, really
    arch = ARCH[model_type]
    assert model_args_fields(saved, arch) == model_args_fields(old, arch)


@pytest.mark.parametrize("cfg, message", [
    (_cfg("llama", **TINY, rope_parameters={"rope_type": "longrope", "rope_theta": 1e4, "factor": 2.0,
                                            "short_factor": [1.0] * 8, "long_factor": [1.0] * 8}), "longrope"),
    (_cfg("llama", **TINY, partial_rotary_factor=0.5), "partial_rotary_factor"),
    (_cfg("llama", **TINY, rope_scaling={"rope_type": "llama3", "factor": 8.0}), "low_freq_factor"),
    (_cfg("llama", **TINY, hidden_act="gelu_new"), "hidden_act"),
])
def test_settings_the_model_cannot_honour_are_refused(tmp_path, cfg, message):
    """Refused by name at load, before any weight is read (the directory holds only config.json)."""
    with pytest.raises(ValueError, match=message):
        model_args_fields(cfg, cfg["architectures"][0])
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), max_model_len=64)


def test_dynamic_rope_refuses_tables_past_max_position_embeddings():
    """NTK-dynamic equals the plain rotation only up to max_position_embeddings (512 here)."""
    scaling = model_args_fields(CONFIG_CASES["llama-v4-dynamic"], "LlamaForCausalLM")["rope_scaling"]
    assert scaling == {"rope_type": "dynamic", "factor": 2.0, "max_position_embeddings": 512}
    rope_inv_freq(16, 1e4, scaling, 512)
    with pytest.raises(ValueError, match="dynamic"):
        rope_inv_freq(16, 1e4, scaling, 513)


# ---- checkpoints saved by transformers: greedy parity -----------------------------------------

def _save_checkpoint(config, out: Path, seed: int = 0) -> Path:
    """A random-weight fp32 checkpoint written by transformers' `save_pretrained`, with our
    tokenizer beside it.  Weights are redrawn with a larger scale than transformers' init
    (random logits well separated, so greedy parity compares decisions, not rounding), and
    norms and biases off their 1/0 init, so a norm or bias the loader missed shows up."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif name.endswith(".bias"):
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.25 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    save_hf_tokenizer(default_tokenizer(1024), out, model_max_length=config.max_position_embeddings)
    return out


# Built with the keyword spelling every transformers accepts (`rope_theta`, `rope_scaling`);
# transformers 5 converts it and writes `rope_parameters`, which the test checks it did.
CHECKPOINTS = {
    "llama-default-rope": lambda: LlamaConfig(**TINY, rope_theta=10000.0),
    "llama-llama3-rope": lambda: LlamaConfig(**TINY, rope_theta=500000.0,
                                             rope_scaling={"rope_type": "llama3", **LLAMA3}),
    "qwen2-qkv-bias-untied": lambda: Qwen2Config(**TINY, tie_word_embeddings=False, rope_theta=1e6),
    "qwen3-qk-norm-tied": lambda: Qwen3Config(**{**TINY, "head_dim": 32}, tie_word_embeddings=True, rope_theta=1e6),
    "mistral-no-window": lambda: MistralConfig(**TINY, sliding_window=None, rope_theta=1e6),
}
CHECKPOINTS |= {  # the context-extension rope types
    "llama-linear-rope": lambda: LlamaConfig(**TINY, rope_theta=1e4, rope_scaling={"rope_type": "linear",
                                                                                  "factor": 4.0}),
    "llama-dynamic-rope": lambda: LlamaConfig(**TINY, rope_theta=1e4, rope_scaling={"rope_type": "dynamic",
                                                                                   "factor": 2.0}),
    "qwen2-yarn-rope": lambda: Qwen2Config(**TINY, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128}),
}
CHECKPOINTS |= {  # a window on the upper layer only: each layer attends its own way
    "qwen2-window-on-upper-layer": lambda: Qwen2Config(**TINY, rope_theta=1e4, use_sliding_window=True,
                                                       sliding_window=8, max_window_layers=1),
}

NEW_TOKENS = 16
# Chunked prefill mixed with decodes: a 12-token step budget, 4-token KV blocks.
CHUNKED = dict(block_size=4, max_num_batched_tokens=12, num_kv_blocks=160, max_model_len=128)


def _assert_written_in_the_installed_format(path: Path) -> None:
    saved = json.loads((path / "config.json").read_text())
    if TRANSFORMERS_5:
        assert "rope_parameters" in saved and "rope_theta" not in saved
    else:
        assert "rope_theta" in saved


def _check_parity(path: Path, prompts: list[list[int]], n: int = NEW_TOKENS, **engine_args) -> None:
    hf = _hf(path)
    ref = _hf_greedy(hf, prompts, n)
    events = []
    llm = LLM(str(path), observers=[events.append], **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=5), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == ref
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            want = hf(torch.tensor([p])).logits[0, -1].float().log_softmax(-1)
        for tok, lp in o.outputs[0].logprobs[0].items():
            assert abs(lp.logprob - want[tok].item()) < 1e-4
    if engine_args.get("max_num_batched_tokens", 10**9) < max(map(len, prompts)):
        assert any(e.phase == "prefill_chunk" for ev in events for e in ev.entries)  # really chunked


@pytest.mark.parametrize("name", sorted(CHECKPOINTS))
def test_checkpoint_saved_by_transformers_generates_what_transformers_generates(tmp_path, name):
    path = _save_checkpoint(CHECKPOINTS[name](), tmp_path)
    _assert_written_in_the_installed_format(path)
    _check_parity(path, _prompts()[:4], **CHUNKED)


def test_mistral_sliding_window_parity_beyond_the_window(tmp_path):
    """Window 8: every prompt and most of the generation run past it; on these weights
    attending outside the window changes most generated tokens (transformers' own output
    with and without the window differs in 14-20 of 20)."""
    path = _save_checkpoint(MistralConfig(**TINY, sliding_window=8, rope_theta=1e4), tmp_path)
    saved = json.loads((path / "config.json").read_text())
    assert model_args_fields(saved, "MistralForCausalLM")["sliding_window"] == 8
    _check_parity(path, [p[:24] for p in _prompts(4)[1:4]], n=20, **CHUNKED)
