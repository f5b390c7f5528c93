"""Read a checkpoint's config.json with the meaning Hugging Face transformers gives it.

config.json is not one format but several: transformers 4 writes rotary settings as a
top-level `rope_theta` plus an optional `rope_scaling` dict (`"type"` or `"rope_type"`);
transformers 5 writes one `rope_parameters` dict holding `rope_type`, `rope_theta` and the
scaling factors.  Keys a file omits take the defaults of *that family's* config class
(Qwen3's head_dim is 128, not hidden/heads; Mistral's sliding window is 4096 unless the
file says null), and switches such as Qwen2's `use_sliding_window` gate other keys.
Reading a key with a generic default silently builds a different model that still runs
and still emits plausible text (a Mixtral without its rope_theta rotates with 1e6, not 1e4;
a Qwen3-MoE layer listed in `mlp_only_layers` is dense), so every field the forward pass needs is resolved here,
once, and `tests/test_hf_checkpoints.py` checks each against the installed transformers'
own config classes and models.

Pure Python (no torch, no transformers import), so the simulator and the estimator can
read a checkpoint the same way the engine does.  Anything tokenloom's model code cannot
honour (a rope type it has no tables for, partial rotary, per-layer windows) is refused
here with a ValueError naming the key, never approximated.
"""

from __future__ import annotations

import math
from typing import Any

# Rotary variants whose tables the model can build.  "dynamic" (NTK-aware) equals "default"
# at every position below max_position_embeddings, which is as far as the engine lets a
# sequence run; transformers only rescales past it, recomputing the rotation of positions
# that a KV cache has already stored.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")

# transformers' default for rope_theta when a config names none (`default_theta`), and the
# families whose config class overrides it.
_DEFAULT_THETA = 10000.0
_FAMILY_THETA = {"MixtralForCausalLM": 1000000.0}

# The defaults of each family's transformers config class, for keys a config.json omits.
# `None` where the class derives the value (head_dim = hidden // heads, kv heads = heads).
_COMMON = dict(
    vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
)
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {**_COMMON, "intermediate_size": 11008, "max_position_embeddings": 2048},
    "MistralForCausalLM": {
        **_COMMON, "intermediate_size": 14336, "max_position_embeddings": 4096 * 32,
        "num_key_value_heads": 8, "sliding_window": 4096,
    },
    "Qwen2ForCausalLM": {
        **_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
        "num_key_value_heads": 32, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None,
    },
    "Qwen3ForCausalLM": {
        **_COMMON, "vocab_size": 151936, "intermediate_size": 22016, "max_position_embeddings": 32768,
        "num_key_value_heads": 32, "head_dim": 128, "use_sliding_window": False, "sliding_window": 4096,
        "max_window_layers": 28, "layer_types": None,
    },
    # Mixture of experts (model/moe.py).  Mixtral's experts are `intermediate_size` wide and
    # every layer is sparse; the Qwen families' experts are `moe_intermediate_size` wide and a
    # layer is dense where `mlp_only_layers` lists it or `decoder_sparse_step` skips it.
    "MixtralForCausalLM": {
        **_COMMON, "intermediate_size": 14336, "max_position_embeddings": 4096 * 32, "rms_norm_eps": 1e-5,
        "num_key_value_heads": 8, "sliding_window": None, "num_local_experts": 8, "num_experts_per_tok": 2,
    },
    "Qwen3MoeForCausalLM": {
        **_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 24,
        "num_key_value_heads": 4, "max_position_embeddings": 32768, "use_sliding_window": False,
        "sliding_window": 4096, "decoder_sparse_step": 1, "moe_intermediate_size": 768, "num_experts_per_tok": 8,
        "num_experts": 128, "norm_topk_prob": False, "mlp_only_layers": None,
    },
    "Qwen2MoeForCausalLM": {
        **_COMMON, "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 24,
        "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 32768,
        "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28, "layer_types": None,
        "decoder_sparse_step": 1, "moe_intermediate_size": 1408, "shared_expert_intermediate_size": 5632,
        "num_experts_per_tok": 4, "num_experts": 60, "norm_topk_prob": False, "mlp_only_layers": None,
        "qkv_bias": True,
    },
}

# Where each family's config.json keeps its expert count, first found wins: Mixtral's and
# Qwen3-MoE's config classes map `num_experts` onto `num_local_experts` (transformers 5 writes
# the latter for Qwen3-MoE; the hub's files hold the former); Qwen2-MoE reads `num_experts`.
_EXPERT_COUNT_KEYS = {
    "MixtralForCausalLM": ("num_local_experts", "num_experts"),
    "Qwen3MoeForCausalLM": ("num_local_experts", "num_experts"),
    "Qwen2MoeForCausalLM": ("num_experts",),
}


def model_args_fields(cfg: dict, architecture: str) -> dict[str, Any]:
    """The `ModelArgs` field values of a config.json dict, for one of the supported
    architectures; ValueError for anything the model code would not honour."""
    if architecture not in _FAMILY_DEFAULTS:
        raise ValueError(f"no config reader for architecture {architecture!r}")
    get = _getter(cfg, architecture)
    act = get("hidden_act")
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act {act!r} is not supported (only silu)")
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    num_layers = int(get("num_hidden_layers"))
    head_dim = int(get("head_dim") or hidden // heads)
    max_pos = int(get("max_position_embeddings"))
    theta, scaling = rope_settings(cfg, max_pos, _FAMILY_THETA.get(architecture, _DEFAULT_THETA))
    qwen2 = architecture == "Qwen2ForCausalLM"
    # Qwen2's attention always carries q/k/v biases and never an o bias, Qwen2-MoE's as its
    # `qkv_bias` says; Mistral's and Mixtral's none (their classes read no attention_bias);
    # Llama, Qwen3 and Qwen3-MoE put attention_bias on all four projections.
    attention_bias = (False if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen2MoeForCausalLM")
                      else bool(get("attention_bias")))
    qkv_bias = True if qwen2 else bool(get("qkv_bias")) if architecture == "Qwen2MoeForCausalLM" else attention_bias
    return dict(
        architecture=architecture,
        vocab_size=int(get("vocab_size")),
        hidden_size=hidden,
        intermediate_size=int(get("intermediate_size")),
        num_layers=num_layers,
        num_heads=heads,
        num_kv_heads=int(get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(get("rms_norm_eps")),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=max_pos,
        tie_word_embeddings=bool(get("tie_word_embeddings")),
        qkv_bias=qkv_bias,
        o_bias=False if qwen2 else attention_bias,
        # Only Llama's MLP reads mlp_bias; the other families' MLPs have no bias.
        mlp_bias=bool(get("mlp_bias")) if architecture == "LlamaForCausalLM" else False,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=sliding_window(cfg, architecture, num_layers),
        **moe_fields(cfg, architecture, num_layers),
    )


def moe_fields(cfg: dict, architecture: str, num_layers: int) -> dict[str, Any]:
    """The mixture-of-experts fields of `ModelArgs` (all zero / empty for a dense family):

    num_experts, num_experts_per_tok   E experts per sparse layer, k chosen per token
    moe_intermediate_size              each expert's SwiGLU width
    shared_expert_intermediate_size    Qwen2-MoE's always-on expert (0: none)
    norm_topk_prob                     the k chosen probabilities renormalised to sum to 1
                                       (Mixtral always; the Qwen families where the key says)
    moe_weights_fp32                   the routing weights scale the experts' outputs in
                                       float32 (Mixtral) or in the model's dtype (Qwen)
    moe_layers                         the indices of the sparse layers; the others are dense
                                       SwiGLU MLPs `intermediate_size` wide
    """
    none = dict(num_experts=0, num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0,
                norm_topk_prob=False, moe_weights_fp32=False, moe_layers=())
    if architecture not in _EXPERT_COUNT_KEYS:
        return none
    get = _getter(cfg, architecture)
    count_key = next((k for k in _EXPERT_COUNT_KEYS[architecture] if cfg.get(k) is not None),
                     _EXPERT_COUNT_KEYS[architecture][0])
    num_experts = int(get(count_key) or 0)
    top_k = int(get("num_experts_per_tok"))
    if num_experts == 0:
        return none  # transformers builds every layer dense
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok {top_k} must be between 1 and the {num_experts} experts")
    if architecture == "MixtralForCausalLM":
        return dict(num_experts=num_experts, num_experts_per_tok=top_k,
                    moe_intermediate_size=int(get("intermediate_size")), shared_expert_intermediate_size=0,
                    norm_topk_prob=True, moe_weights_fp32=True, moe_layers=tuple(range(num_layers)))
    step = int(get("decoder_sparse_step") or 1)
    dense = set(get("mlp_only_layers") or ())
    return dict(
        num_experts=num_experts, num_experts_per_tok=top_k,
        moe_intermediate_size=int(get("moe_intermediate_size")),
        shared_expert_intermediate_size=(int(get("shared_expert_intermediate_size") or 0)
                                         if architecture == "Qwen2MoeForCausalLM" else 0),
        norm_topk_prob=bool(get("norm_topk_prob")), moe_weights_fp32=False,
        moe_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


def _getter(cfg: dict, architecture: str):
    defaults = _FAMILY_DEFAULTS[architecture]

    def get(key: str) -> Any:
        return cfg[key] if key in cfg else defaults.get(key)

    return get


def sliding_window(cfg: dict, architecture: str, num_layers: int) -> int | None:
    """The attention window every layer uses (None: full causal attention).

    Mistral and Mixtral apply `sliding_window` to every layer, Qwen3-MoE too but only when
    `use_sliding_window` is set.  Qwen2/Qwen3/Qwen2-MoE apply it only when
    `use_sliding_window` is set, and only to the layers `layer_types` marks
    "sliding_attention" — by default those with index >= `max_window_layers` (Qwen2-MoE:
    the even-numbered ones below it).  Llama has no window (a stray key is ignored, as
    transformers ignores it).  A model whose layers differ is refused: `ModelArgs` holds
    one window for all layers.
    """
    get = _getter(cfg, architecture)
    if architecture in ("MistralForCausalLM", "MixtralForCausalLM"):
        return _window(get("sliding_window"))
    if architecture == "Qwen3MoeForCausalLM":
        return _window(get("sliding_window")) if get("use_sliding_window") else None
    if architecture not in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        return None
    window = _window(get("sliding_window")) if get("use_sliding_window") else None
    layer_types = get("layer_types")
    if layer_types is None:
        first_sliding = int(get("max_window_layers"))
        if architecture == "Qwen2MoeForCausalLM":
            layer_types = ["sliding_attention" if window is not None and i % 2 == 0 and i < first_sliding
                           else "full_attention" for i in range(num_layers)]
        else:
            layer_types = ["sliding_attention" if window is not None and i >= first_sliding else "full_attention"
                           for i in range(num_layers)]
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers")
    windows = {window if t == "sliding_attention" else None for t in layer_types}
    if len(windows) > 1:
        raise ValueError(
            f"this checkpoint mixes sliding-window ({window}) and full-attention layers "
            f"(use_sliding_window with max_window_layers/layer_types); tokenloom runs one "
            f"attention window for all layers")
    return windows.pop()


def _window(value: Any) -> int | None:
    if value is None:
        return None
    if int(value) < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {value!r}")
    return int(value)


def rope_settings(cfg: dict, max_position_embeddings: int,
                  default_theta: float = _DEFAULT_THETA) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either config format, as transformers normalises them.

    `scaling` is None for plain rotary embeddings, else a dict holding `rope_type` and
    every parameter its frequency table needs, resolved (defaults filled in, yarn's
    attention factor computed), so the table builder reads no defaults of its own.
    As in transformers, `rope_scaling` wins over `rope_parameters` when a file has both,
    and a theta inside the dict wins over a top-level one; `default_theta` (the family's)
    where neither names one.
    """
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"rope_parameters must be a dict, got {raw!r}")
    if raw and all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"per-layer-type rotary settings ({', '.join(raw)}) are not supported")
    params = dict(raw)
    theta = params.get("rope_theta", cfg.get("rope_theta", default_theta))
    theta = float(theta if theta is not None else default_theta)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    partial = params.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (tokenloom rotates whole heads)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn"):
        # transformers: a top-level original_max_position_embeddings (Phi-3 style) wins,
        # else the dict's own, else max_position_embeddings.
        orig = cfg.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        params["original_max_position_embeddings"] = int(orig or max_position_embeddings)
    if rope_type == "linear":
        return theta, {"rope_type": "linear", "factor": _factor(params)}
    if rope_type == "dynamic":
        return theta, {"rope_type": "dynamic", "factor": _factor(params),
                       "max_position_embeddings": int(max_position_embeddings)}
    if rope_type == "llama3":
        return theta, {
            "rope_type": "llama3",
            "factor": _factor(params),
            "low_freq_factor": float(_required(params, "low_freq_factor", rope_type)),
            "high_freq_factor": float(_required(params, "high_freq_factor", rope_type)),
            "original_max_position_embeddings": params["original_max_position_embeddings"],
        }
    return theta, _yarn(params, max_position_embeddings)


def _yarn(params: dict, max_position_embeddings: int) -> dict:
    """YaRN's parameters with transformers' defaults: factor from the context extension
    when absent, the attention factor (cos/sin scale) from the paper's mscale, beta_fast
    32, beta_slow 1, truncated correction range."""
    orig = params["original_max_position_embeddings"]
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    truncate = params.get("truncate")
    return {
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": orig,
        "attention_factor": float(attention_factor),
        "beta_fast": float(params.get("beta_fast") or 32),
        "beta_slow": float(params.get("beta_slow") or 1),
        "truncate": True if truncate is None else bool(truncate),
    }


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature (its paper's eq. 21): 0.1 * mscale * ln(s) + 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _factor(params: dict) -> float:
    return float(_required(params, "factor", params.get("rope_type", params.get("type"))))


def _required(params: dict, key: str, rope_type: str) -> Any:
    if params.get(key) is None:
        raise ValueError(f"rope type {rope_type!r} needs {key!r} in rope_parameters/rope_scaling")
    return params[key]
