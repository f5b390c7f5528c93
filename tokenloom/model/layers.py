"""Building blocks shared by the decoder families: RMSNorm, rotary embeddings, gated MLP,
and how a layer calls its linears (`bound_linear`).

Rotary embeddings are what make a decode step position-aware without recomputing the
past: the new token's Q and K are rotated by *its* position, the cached K of earlier
tokens were rotated once when they were written, so attention over the KV history
needs nothing recomputed (the seed: "Decode 不是把全部 token 再算一遍").
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.ops import TORCH, Ops, rotate  # noqa: F401 (rotate: the reference, re-exported)
from tokenloom.model.rope_scaling import rope_inv_freqs


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.ops: Ops = TORCH  # the model's ops backend (CausalLM.bind)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, the residual stream's add first: returns (norm(x +
        residual), x + residual)."""
        if residual is not None:
            return self.ops.add_rms_norm(x, residual, self.weight, self.eps)
        return self.ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (HF's rotate_half layout).

    LongRoPE beyond its pretraining length keeps a second table after the first: a request
    longer than `long_from` tokens reads rows `long_offset` + position (the model runner
    offsets its positions), so every kernel that gathers rows by position reads the right
    one without knowing there are two."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        # every rope type's frequencies (and YaRN's and LongRoPE's attention factor), as transformers computes them
        inv_freqs, attention_factor, self.long_from = rope_inv_freqs(head_dim, theta, scaling, max_positions)
        self.long_offset = max_positions
        t = torch.arange(max_positions, dtype=torch.float32)
        emb = torch.cat([torch.cat([f, f], dim=-1) for f in (torch.outer(t, inv) for inv in inv_freqs)], dim=0)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        self.ops: Ops = TORCH  # the model's ops backend (CausalLM.bind)

    def at(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """`rotate`'s tables for `positions`: the cos rows and the sin rows with rotate-half's
        sign folded in ([T, 1, D], cast to `dtype` as the reference casts them).  Made once
        per step for every layer: on a GPU each gather, cast and negation is a kernel launch,
        and a small model's step there is bound by launches."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        half = sin.shape[-1] // 2
        return cos, torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                cs: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hk, D] rotated by `positions`; `cs`: `at(positions, q.dtype)`,
        if the caller has it."""
        return self.ops.rope(q, k, positions, self.cos, self.sin, cs if cs is not None else self.at(positions, q.dtype))


class GatedMLP(nn.Module):
    """A gated MLP's weights, gate and up projections fused into one matmul at load time:
    down(act(gate) * up), SiLU (SwiGLU) or GELU (GeGLU).  `bind` makes the callable its
    layer runs (model/llama.py `LayerStep`)."""

    def __init__(self, hidden: int, intermediate: int, bias: bool, act: str = "silu"):
        super().__init__()
        self.intermediate = intermediate
        self.act = act
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def bind(self, ops: Ops, flat: bool, wrap: "WrapLinear | None" = None) -> Callable[[torch.Tensor], torch.Tensor]:
        """h -> down(act(gate) * up), its linears called as `bound_linear` makes them (then
        through `wrap`, if given: `wrap("gate_up", fn)`, `wrap("down", fn)`) and the
        activation from `ops` (chosen here, once)."""
        gate_up, down = bound_linear(self.gate_up_proj, flat), bound_linear(self.down_proj, flat)
        if wrap is not None:
            gate_up, down = wrap("gate_up", gate_up), wrap("down", down)
        act_and_mul = ops.act_and_mul(self.act)

        def mlp(h):
            return down(act_and_mul(gate_up(h)))

        mlp.act_and_mul = act_and_mul  # what it was bound to, for whoever checks the plan took
        return mlp


Linear = Callable[[torch.Tensor], torch.Tensor]
# What may wrap a layer's bound linears (by name: qkv, o, gate_up, down), e.g. LoRA's deltas
# beside them (model/lora.py `lora_wrapper`, which adds the layer's index)
WrapLinear = Callable[[str, Linear], Linear]


def bound_linear(m: nn.Module, flat: bool) -> Linear:
    """How a layer calls the linear `m`: with `flat`, its forward as a plain function of x
    where it has one (packed, panel and quantized linears' `as_function`, plain nn.Linear),
    which skips nn.Module's dispatch on every call; otherwise, and for a linear whose
    forward also communicates (a tensor-parallel shard), the module itself."""
    if flat:
        if hasattr(m, "as_function"):
            return m.as_function()
        if type(m) is nn.Linear:
            return functools.partial(F.linear, weight=m.weight, bias=m.bias)
    return m
