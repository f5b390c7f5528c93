"""Building blocks shared by the decoder families: RMSNorm, rotary embeddings, SwiGLU MLP.

Rotary embeddings are what make a decode step position-aware without recomputing the
past: the new token's Q and K are rotated by *its* position, the cached K of earlier
tokens were rotated once when they were written, so attention over the KV history
needs nothing recomputed (the seed: "Decode 不是把全部 token 再算一遍").
"""

from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import nn

from tokenloom.model.rope_scaling import rope_inv_freq

# The dtypes our fused CPU ops take (kernels/cpu_fused.cpp); the rotary-only op takes float32.
# In bfloat16 they round wherever the reference's separate ops do.
FUSED_DTYPES = (torch.float32, torch.bfloat16)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = None  # our one-pass float32 ops on CPU (CausalLM.use_fused_cpu_ops)
        self.fused_add = None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with `residual`, the residual stream's add first: returns (norm(x +
        residual), x + residual)."""
        if residual is not None:
            if self.fused_add is not None and x.dtype in FUSED_DTYPES:
                return self.fused_add(x, residual, self.weight, self.eps)
            x = x + residual
            return self.forward(x), x
        if self.fused is not None and x.dtype in FUSED_DTYPES:
            return self.fused(x, self.weight, self.eps)
        if x.dtype == torch.float32 or x.device.type != "cpu":
            # PyTorch's own: one fused kernel on GPUs (six launches fewer per norm), the
            # reference's ops in the reference's order on CPUs (bit-exact in float32).  In
            # bf16/fp16 it applies the weight before rounding, once, where the reference
            # rounds twice: a rounding step apart at most, so on CPUs, where no kernel is
            # saved, the reference's order stays.
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        # Normalize in float32 like the reference implementations, so bf16/fp16 match them.
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """Precomputed cos/sin tables indexed by absolute position (HF's rotate_half layout)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        # every rope type's frequencies (and YaRN's attention factor), as transformers computes them
        inv_freq, attention_factor = rope_inv_freq(head_dim, theta, scaling, max_positions)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos() * attention_factor, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_factor, persistent=False)
        self.fused = None  # our one-pass float32 op on CPU (CausalLM.use_fused_cpu_ops)
        self.fused_kv = None  # the same, reading the qkv output and writing the KV cache

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
        # q: [T, Hq, D], k: [T, Hk, D]; cs: `at(positions, q.dtype)`, if the caller has it
        if self.fused is not None and q.dtype == torch.float32:
            return self.fused(q, k, positions, self.cos, self.sin)
        cos, sin = cs if cs is not None else self.at(positions, q.dtype)
        return rotate(q, cos, sin), rotate(k, cos, sin)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by `RotaryEmbedding.at`'s tables: the reference's x * cos +
    rotate_half(x) * sin, with rotate_half = cat(-x2, x1) and the sign moved into the table
    (x2 * -sin1 is (-x2) * sin1 exactly), in the reference's order and dtype, so bf16/fp16
    runs round the same way."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * signed_sin


class GatedMLP(nn.Module):
    """SwiGLU MLP with gate and up projections fused into one matmul at load time."""

    def __init__(self, hidden: int, intermediate: int, bias: bool):
        super().__init__()
        self.intermediate = intermediate
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.fused_act = None  # our one-pass SiLU(gate) * up on CPU (CausalLM.use_fused_cpu_ops)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if self.fused_act is not None and gu.dtype in FUSED_DTYPES:
            return self.down_proj(self.fused_act(gu))
        gate, up = gu.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate) * up)
