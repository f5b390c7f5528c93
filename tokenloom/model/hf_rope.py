"""A checkpoint's rotary settings, read with the meaning transformers gives them.

transformers 4 writes a top-level `rope_theta` plus an optional `rope_scaling` dict
(`"type"` or `"rope_type"`); transformers 5 writes one `rope_parameters` dict holding
`rope_type`, `rope_theta` and the scaling factors -- or, for families whose layer types
rotate differently (Gemma 3: a local base frequency on sliding layers), one such dict per
layer type.  `rope_settings` resolves either into (theta, scaling), `scaling` holding every
parameter its frequency table needs (model/rope_scaling.py reads no defaults of its own).

Pure Python (no torch): the simulator and the estimator read checkpoints the same way.
"""

from __future__ import annotations

import math
from typing import Any

# Rotary variants whose tables the model can build.  "dynamic" (NTK-aware) equals "default"
# at every position below max_position_embeddings, which is as far as the engine lets a
# sequence run; transformers only rescales past it, recomputing the rotation of positions
# that a KV cache has already stored.  "longrope" (Phi-3's long-context rotation) has two
# tables, one for sequences up to original_max_position_embeddings and one beyond.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")

# transformers' default for rope_theta when a config names none (`default_theta`).
DEFAULT_THETA = 10000.0

# The per-layer-type keys transformers nests rotary settings under.
LAYER_TYPES = ("full_attention", "sliding_attention")


def rope_settings(cfg: dict, max_position_embeddings: int, *, original_max: int | None = None,
                  aliases: dict[str, str] | None = None) -> tuple[float, dict | None]:
    """(rope_theta, scaling) of a config with one rotation for every layer.

    As in transformers, `rope_scaling` wins over `rope_parameters` when a file has both,
    and a theta inside the dict wins over a top-level one.  `original_max`: the family's
    top-level original_max_position_embeddings (Phi-3 has one, with a class default, and
    transformers lets it win over the dict's); `aliases`: old rope type names the family's
    config class renames (Phi-3: "su" and "yarn" both mean "longrope")."""
    raw = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    if not isinstance(raw, dict):
        raise ValueError(f"rope_parameters must be a dict, got {raw!r}")
    if raw and all(isinstance(v, dict) for v in raw.values()):
        raise ValueError(f"per-layer-type rotary settings ({', '.join(raw)}) are not read for this architecture")
    theta = raw.get("rope_theta", cfg.get("rope_theta", DEFAULT_THETA))
    partial = raw.get("partial_rotary_factor", cfg.get("partial_rotary_factor"))
    if original_max is None:
        original_max = cfg.get("original_max_position_embeddings")
    return resolve_rope(raw, theta, partial, max_position_embeddings, original_max, aliases)


def per_layer_type_rope(cfg: dict, max_position_embeddings: int, defaults: dict[str, float],
                        local_theta_key: str) -> dict[str, tuple[float, dict | None]]:
    """{layer type: (theta, scaling)} of a family that rotates each layer type its own way
    (Gemma 3): transformers 5's nested `rope_parameters`, or transformers 4's top-level
    `rope_theta` + `rope_scaling` (full-attention layers) and `local_theta_key` (sliding
    layers, default rotation).  `defaults`: the config class's theta per layer type."""
    nested = cfg.get("rope_parameters") or {}
    if not isinstance(nested, dict):
        raise ValueError(f"rope_parameters must be a dict, got {nested!r}")
    if nested and not all(k in LAYER_TYPES and isinstance(v, (dict, type(None))) for k, v in nested.items()):
        raise ValueError(f"rope_parameters must hold one dict per layer type ({', '.join(LAYER_TYPES)}) for this "
                         f"architecture, got keys {', '.join(nested)}")
    full = dict(nested.get("full_attention") or {})
    local = dict(nested.get("sliding_attention") or {})
    if cfg.get("rope_scaling"):  # transformers applies a 4.x rope_scaling to the full-attention layers
        full.update(cfg["rope_scaling"])
    full.setdefault("rope_theta", cfg.get("rope_theta", defaults["full_attention"]))
    local.setdefault("rope_theta", cfg.get(local_theta_key, defaults["sliding_attention"]))
    partial = cfg.get("partial_rotary_factor")
    return {t: resolve_rope(p, p["rope_theta"], p.get("partial_rotary_factor", partial), max_position_embeddings,
                            None, None)
            for t, p in (("full_attention", full), ("sliding_attention", local))}


def resolve_rope(raw: dict, theta: Any, partial: Any, max_position_embeddings: int, original_max: int | None,
                 aliases: dict[str, str] | None) -> tuple[float, dict | None]:
    """One rotation's (theta, scaling) from its parameter dict."""
    params = dict(raw)
    theta = float(theta if theta is not None else DEFAULT_THETA)
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    rope_type = (aliases or {}).get(rope_type, rope_type)
    if partial is not None and float(partial) != 1.0:
        raise ValueError(f"partial_rotary_factor {partial} is not supported (tokenloom rotates whole heads; "
                         f"Phi-4-mini's partial rotation is not run)")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"rope type {rope_type!r} is not supported (supported: {', '.join(SUPPORTED_ROPE_TYPES)})")
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn", "longrope"):
        # transformers: a top-level original_max_position_embeddings (Phi-3 style) wins,
        # else the dict's own, else max_position_embeddings.
        orig = original_max or params.get("original_max_position_embeddings")
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
    if rope_type == "longrope":
        return theta, _longrope(params, max_position_embeddings)
    return theta, _yarn(params, max_position_embeddings)


def _longrope(params: dict, max_position_embeddings: int) -> dict:
    """LongRoPE's parameters: per-frequency divisors for sequences up to the pretraining
    length (`short_factor`) and beyond it (`long_factor`), and the cos/sin scale, which
    transformers derives from the context extension max/original when the file gives
    neither `attention_factor` nor `factor`."""
    orig = params["original_max_position_embeddings"]
    short = [float(x) for x in _required(params, "short_factor", "longrope")]
    long = [float(x) for x in _required(params, "long_factor", "longrope")]
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / orig
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig))
    return {"rope_type": "longrope", "short_factor": short, "long_factor": long,
            "original_max_position_embeddings": orig, "attention_factor": float(attention_factor)}


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
