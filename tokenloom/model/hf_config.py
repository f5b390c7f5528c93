"""Read a checkpoint's config.json with the meaning Hugging Face transformers gives it.

config.json is not one format but several (rotary settings: model/hf_rope.py).  Keys a
file omits take the defaults of *that family's* config class (Qwen3's head_dim is 128, not
hidden/heads; Mistral's sliding window is 4096 unless the file says null; Gemma 2 caps its
logits at 30 unless the file says null), and switches such as Qwen2's `use_sliding_window`
gate other keys.  Reading a key with a generic default silently builds a different model
that still runs and still emits plausible text, so every field the forward pass needs is
resolved here, once, and tests/test_hf_checkpoints.py and tests/test_families.py check each
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
}
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
        theta, scaling = rope_settings(cfg, max_pos)
    if scaling is not None and scaling["rope_type"] == "longrope":
        if not phi3:  # transformers recomputes the cache at the switch for Phi-3 only; the others keep stale keys
            raise ValueError("rope type 'longrope' is read for Phi-3 only (Phi3ForCausalLM)")
        _check_longrope(scaling, head_dim)
    qwen2, mistral = architecture == "Qwen2ForCausalLM", architecture == "MistralForCausalLM"
    # Qwen2's attention always carries q/k/v biases and never an o bias; Mistral's and Phi-3's
    # none (their classes do not read attention_bias); the others put it on all four projections.
    attention_bias = False if mistral or phi3 else bool(get("attention_bias"))
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
        qkv_bias=True if qwen2 else attention_bias,
        o_bias=False if qwen2 else attention_bias,
        # Only Llama's MLP reads mlp_bias; the other families' MLPs have no bias.
        mlp_bias=bool(get("mlp_bias")) if architecture == "LlamaForCausalLM" else False,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Gemma3ForCausalLM"),
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
    )


def _getter(cfg: dict, architecture: str):
    defaults = _FAMILY_DEFAULTS[architecture]

    def get(key: str) -> Any:
        return cfg[key] if key in cfg else defaults.get(key)

    return get


def layer_types(cfg: dict, architecture: str, num_layers: int) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention ("sliding_attention" or "full_attention") and the window the
    sliding ones use (None where no layer slides), as the family's config class decides.

    Mistral and Phi-3 apply `sliding_window` to every layer.  Qwen2/Qwen3 apply it only when
    `use_sliding_window` is set, and only to the layers `layer_types` marks sliding -- by
    default those with index >= `max_window_layers`.  Gemma 2 alternates, sliding first;
    Gemma 3 slides on all but every `sliding_window_pattern`-th layer (6); either takes an
    explicit `layer_types`.  Llama has no window (a stray key is ignored, as transformers
    ignores it)."""
    get = _getter(cfg, architecture)
    if architecture in ("MistralForCausalLM", "Phi3ForCausalLM"):
        window = _window(get("sliding_window"))
        return ((SLIDING if window is not None else FULL,) * num_layers), window
    if architecture == "LlamaForCausalLM":
        return (FULL,) * num_layers, None
    types = get("layer_types")
    if architecture in ("Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        window = _window(get("sliding_window")) if get("use_sliding_window") else None
        if types is None:
            first_sliding = int(get("max_window_layers"))
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
