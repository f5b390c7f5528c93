"""Rotary frequencies for each rope type a checkpoint may name.

A rotary embedding turns position p into rotations by angles p * inv_freq[i], one per pair of
head dimensions.  Context-extension schemes change only `inv_freq` (and, for YaRN, scale the
cos/sin tables by a constant "attention factor"), so one function maps (head_dim, theta,
scaling) to both, and the table builder stays the same for every type.  `scaling` is the
resolved dict `hf_rope.rope_settings` returns: every parameter is already there.

LongRoPE (Phi-3) rotates a whole sequence with one of two sets of frequencies, chosen by
the sequence's length: `short_factor` up to original_max_position_embeddings tokens,
`long_factor` beyond.  `rope_inv_freqs` returns both where the tables reach past that
length; which one a request reads is the model runner's choice (by its length).

The arithmetic follows transformers' order of operations, so the tables come out bit for bit
the same in float32 (tests/test_hf_checkpoints.py compares them).
"""

from __future__ import annotations

import math

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None,
                  max_positions: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim // 2] float32, attention factor to multiply cos and sin by).

    `max_positions`: the longest sequence the tables will serve; "dynamic" scaling is only
    the plain rotation up to the checkpoint's max_position_embeddings, and beyond it would
    change the angles of positions already in the KV cache, so a longer table is refused."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = (scaling or {}).get("rope_type", "default")
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / scaling["factor"], 1.0
    if rope_type == "dynamic":
        limit = scaling["max_position_embeddings"]
        if max_positions is not None and max_positions > limit:
            raise ValueError(f"dynamic rope scaling is the plain rotation only up to max_position_embeddings "
                             f"({limit}); {max_positions} positions were asked for")
        return inv_freq, 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, scaling), 1.0
    if rope_type == "yarn":
        return _yarn(head_dim, theta, scaling), scaling["attention_factor"]
    if rope_type == "longrope":
        return _longrope(head_dim, theta, scaling["short_factor"]), scaling["attention_factor"]
    raise ValueError(f"rope type {rope_type!r} has no frequency table in tokenloom")


def rope_inv_freqs(head_dim: int, theta: float, scaling: dict | None,
                   max_positions: int) -> tuple[list[torch.Tensor], float, int | None]:
    """Every frequency set a rotation needs for tables of `max_positions` rows: ([inv_freq,
    ...], attention factor, the sequence length past which the second set applies).  One set
    (and None) for every type but longrope with tables longer than its pretraining length."""
    inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
    if scaling is not None and scaling["rope_type"] == "longrope":
        orig = scaling["original_max_position_embeddings"]
        if max_positions > orig:
            return [inv_freq, _longrope(head_dim, theta, scaling["long_factor"])], attention_factor, orig
    return [inv_freq], attention_factor, None


def _longrope(head_dim: int, theta: float, factors: list[float]) -> torch.Tensor:
    """LongRoPE: each default frequency divided by its own factor."""
    ext = torch.tensor(factors, dtype=torch.float32)
    return 1.0 / (ext * theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))


def _llama3(inv_freq: torch.Tensor, s: dict) -> torch.Tensor:
    """Llama 3.1: long wavelengths (beyond the pretraining context / low_freq_factor) slowed by
    `factor`, short ones kept, the band between blended linearly in 1/wavelength."""
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    in_band = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(in_band, blended, scaled)


def _yarn(head_dim: int, theta: float, s: dict) -> torch.Tensor:
    """YaRN: dimensions that turn many times within the pretraining context keep their
    frequency (extrapolate), those that turn less than once are divided by `factor`
    (interpolate), with a linear ramp between the two dimension bounds."""
    factor, orig = s["factor"], s["original_max_position_embeddings"]

    def dim_for(rotations: float) -> float:  # the dimension that turns `rotations` times in orig tokens
        return (head_dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = dim_for(s["beta_fast"]), dim_for(s["beta_slow"])
    if s["truncate"]:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep
