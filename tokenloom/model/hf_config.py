"""Read a checkpoint's config.json with the meaning Hugging Face transformers gives it.

config.json is not one format but several (rotary settings: model/hf_rope.py).  Keys a
file omits take the defaults of *that family's* config class (Qwen3's head_dim is 128, not
hidden/heads; Mistral's sliding window is 4096 unless the file says null; Gemma 2 caps its
logits at 30 unless the file says null), and switches such as Qwen2's `use_sliding_window`
gate other keys.  Reading a key with a generic default silently builds a different model
that still runs and still emits plausible text (a Mixtral without its rope_theta rotates
with 1e6, not 1e4; a Qwen3-MoE layer listed in `mlp_only_layers` is dense), so every
field the forward pass needs is resolved here, once, and tests/test_hf_checkpoints.py and tests/test_families.py check each
against the installed transformers' own config classes and models.

Pure Python (no torch, no transformers import), so the simulator and the estimator can
read a checkpoint the same way the engine does.  Anything tokenloom's model code cannot
honour (a rope type it has no tables for, partial rotary, bidirectional attention) is
refused here with a ValueError naming the key, never approximated.
"""

from __future__ import annotations

from typing import Any

from tokenloom.model.hf_rope import SUPPORTED_ROPE_TYPES, per_layer_type_rope, rope_settings

__all__ = ["SUPPORTED_ROPE_TYPES", "model_args_fields", "rope_settings", "layer_types"]

SLIDING, FULL = "sliding_attention", "full_attention"

# The MLP activations the model runs (GeGLU's two GELUs and SwiGLU's SiLU), as transformers names them.
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh", "gelu")

# The defaults of each family's transformers config class, for keys a config.json omits.
# `None` where the class derives the value (head_dim = hidden // heads, kv heads = heads).
_COMMON = dict(
    vocab_size=32000, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, rms_norm_eps=1e-6, hidden_act="silu",
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
)
_GEMMA_COMMON = dict(
    hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8, num_key_value_heads=4,
    head_dim=256, hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
    attention_bias=False, query_pre_attn_scalar=256, sliding_window=4096, layer_types=None,
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
    "Gemma2ForCausalLM": {
        **_GEMMA_COMMON, "vocab_size": 256000, "max_position_embeddings": 8192,
        "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0, "use_bidirectional_attention": None,
    },
    "Gemma3ForCausalLM": {
        **_GEMMA_COMMON, "vocab_size": 262208, "max_position_embeddings": 131072,
        "final_logit_softcapping": None, "attn_logit_softcapping": None, "use_bidirectional_attention": False,
        "sliding_window_pattern": 6,
    },
    "Phi3ForCausalLM": {
        **_COMMON, "vocab_size": 32064, "hidden_size": 3072, "intermediate_size": 8192, "rms_norm_eps": 1e-5,
        "max_position_embeddings": 4096, "original_max_position_embeddings": 4096, "sliding_window": None,
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
# transformers' rope_theta for a config that names none, where the family's class overrides
# the common 1e4 (`default_theta`).
_FAMILY_THETA = {"MixtralForCausalLM": 1000000.0}
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
# Gemma 3's rotation per layer type when the file names none (Gemma3TextConfig.default_theta).
_GEMMA3_THETA = {FULL: 1_000_000.0, SLIDING: 10_000.0}
# Phi-3's config class renames these old rope types to "longrope".
_PHI3_ROPE_ALIASES = {"su": "longrope", "yarn": "longrope"}


def model_args_fields(cfg: dict, architecture: str) -> dict[str, Any]:
    """The `ModelArgs` field values of a config.json dict, for one of the supported
    architectures; ValueError for anything the model code would not honour."""
    if architecture not in _FAMILY_DEFAULTS:
        raise ValueError(f"no config reader for architecture {architecture!r}")
    get = _getter(cfg, architecture)
    gemma, phi3 = architecture in _GEMMA, architecture == "Phi3ForCausalLM"
    act_key = "hidden_activation" if gemma else "hidden_act"  # Gemma's classes read hidden_activation only
    act = get(act_key)
    if act not in ACTIVATIONS:
        raise ValueError(f"{act_key} {act!r} is not supported (supported: {', '.join(ACTIVATIONS)})")
    if gemma and get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (tokenloom runs causal decoders)")
    hidden, heads = int(get("hidden_size")), int(get("num_attention_heads"))
    num_layers = int(get("num_hidden_layers"))
    head_dim = int(get("head_dim") or hidden // heads)
    max_pos = int(get("max_position_embeddings"))
    local_theta, local_scaling = None, None
    if architecture == "Gemma3ForCausalLM":
        ropes = per_layer_type_rope(cfg, max_pos, _GEMMA3_THETA, "rope_local_base_freq")
        (theta, scaling), (local_theta, local_scaling) = ropes[FULL], ropes[SLIDING]
    elif phi3:
        theta, scaling = rope_settings(cfg, max_pos, original_max=int(get("original_max_position_embeddings")),
                                       aliases=_PHI3_ROPE_ALIASES)
        if (scaling or {}).get("rope_type", "longrope") != "longrope":
            raise ValueError(f"Phi-3's rope type must be longrope (or su), got {scaling['rope_type']!r}")
    else:
        family_theta = _FAMILY_THETA.get(architecture)
        rope_cfg = cfg if family_theta is None or "rope_theta" in cfg else {**cfg, "rope_theta": family_theta}
        theta, scaling = rope_settings(rope_cfg, max_pos)
    if scaling is not None and scaling["rope_type"] == "longrope":
        if not phi3:  # transformers recomputes the cache at the switch for Phi-3 only; the others keep stale keys
            raise ValueError("rope type 'longrope' is read for Phi-3 only (Phi3ForCausalLM)")
        _check_longrope(scaling, head_dim)
    qwen2, qwen2_moe = architecture == "Qwen2ForCausalLM", architecture == "Qwen2MoeForCausalLM"
    # Qwen2's attention always carries q/k/v biases and never an o bias, Qwen2-MoE's as its
    # `qkv_bias` says; Mistral's, Mixtral's and Phi-3's none (their classes do not read
    # attention_bias); the others put it on all four projections.
    attention_bias = (False if architecture in ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM")
                      or qwen2_moe else bool(get("attention_bias")))
    types, window = layer_types(cfg, architecture, num_layers)
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
        qkv_bias=True if qwen2 else bool(get("qkv_bias")) if qwen2_moe else attention_bias,
        o_bias=False if qwen2 else attention_bias,
        # Only Llama's MLP reads mlp_bias; the other families' MLPs have no bias.
        mlp_bias=bool(get("mlp_bias")) if architecture == "LlamaForCausalLM" else False,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM", "Qwen3MoeForCausalLM"),
        sliding_window=window,
        layer_types=types,
        hidden_act="silu" if act == "swish" else act,
        # Gemma: scores scaled by query_pre_attn_scalar^-1/2, not head_dim^-1/2; Gemma 3's
        # attention layer never passes its attn_logit_softcapping on, so only Gemma 2 caps.
        query_pre_attn_scalar=float(get("query_pre_attn_scalar")) if gemma else None,
        attn_softcap=_cap(get("attn_logit_softcapping")) if architecture == "Gemma2ForCausalLM" else None,
        final_softcap=_cap(get("final_logit_softcapping")) if gemma else None,
        # Gemma: embeddings times sqrt(hidden); RMSNorm weights stored as offsets from 1
        # (x * (1 + w)); a norm after attention and around the MLP as well ("sandwich").
        embed_scale=hidden ** 0.5 if gemma else None,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norm=gemma,
        local_rope_theta=local_theta,
        local_rope_scaling=local_scaling,
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


def layer_types(cfg: dict, architecture: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention ("sliding_attention" or "full_attention") and the window the
    sliding ones use (None where no layer slides), as the family's config class decides.

    Mistral, Mixtral and Phi-3 apply `sliding_window` to every layer, Qwen3-MoE too where
    `use_sliding_window` is set.  Qwen2/Qwen3/Qwen2-MoE apply it only when
    `use_sliding_window` is set, and only to the layers `layer_types` marks sliding -- by
    default those with index >= `max_window_layers` (Qwen2-MoE: the even-numbered ones
    below it).  Gemma 2 alternates, sliding first;
    Gemma 3 slides on all but every `sliding_window_pattern`-th layer (6); either takes an
    explicit `layer_types`.  Llama has no window (a stray key is ignored, as transformers
    ignores it)."""
    get = _getter(cfg, architecture)
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        on = architecture != "Qwen3MoeForCausalLM" or get("use_sliding_window")
        window = _window(get("sliding_window")) if on else None
        return ((SLIDING if window is not None else FULL,) * num_layers), window
    if architecture == "LlamaForCausalLM":
        return (FULL,) * num_layers, None
    types = get("layer_types")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        window = _window(get("sliding_window")) if get("use_sliding_window") else None
        if types is None:
            first_sliding = int(get("max_window_layers"))
            if architecture == "Qwen2MoeForCausalLM":
                types = [SLIDING if window is not None and i % 2 == 0 and i < first_sliding else FULL
                         for i in range(num_layers)]
            else:
                types = [SLIDING if window is not None and i >= first_sliding else FULL for i in range(num_layers)]
        # with use_sliding_window off a "sliding" layer type keeps full attention (no window)
        types = [t if window is not None else FULL for t in types]
    else:  # Gemma 2 / 3
        window = _window(get("sliding_window"))
        if types is None:
            every = 2 if architecture == "Gemma2ForCausalLM" else int(get("sliding_window_pattern"))
            types = [SLIDING if (i + 1) % every else FULL for i in range(num_layers)]
    types = tuple(types)
    if len(types) != num_layers:
        raise ValueError(f"layer_types has {len(types)} entries for {num_layers} layers")
    if set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types may hold only {SLIDING!r} and {FULL!r}, got {sorted(set(types))}")
    return types, window if SLIDING in types else None


def _window(value: Any) -> int | None:
    if value is None:
        return None
    if int(value) < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {value!r}")
    return int(value)


def _cap(value: Any) -> float | None:
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"logit soft-capping must be a positive number, got {value!r}")
    return float(value)


def _check_longrope(scaling: dict, head_dim: int) -> None:
    for key in ("short_factor", "long_factor"):
        if len(scaling[key]) != head_dim // 2:
            raise ValueError(f"longrope {key} has {len(scaling[key])} entries; a head of {head_dim} needs "
                             f"{head_dim // 2}")
