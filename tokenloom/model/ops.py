"""The model's small ops (norms, rotary, the gated MLPs' activations), one implementation set
chosen once (model/backends.py): the *ops backend*.

    torch   PyTorch's ops in the reference's order and roundings: the reference, and what
            runs wherever nothing faster does
    cpu     our one-pass C++ ops (kernels/cpu_fused.cpp), float32 and bfloat16, where they build
    triton  our Triton kernels (kernels/triton/fused.py), with the triton attention backend

Layers call `self.ops.<op>` and never look at dtypes, devices or flags: what cannot run for
this model's dtype is left at the reference when the set is built.  `rope_write_kv`, where
a backend has it, rotates q and k and writes k and v into the paged cache in one pass; it
is None where the attention backend writes the cache itself (and under torch.compile,
which would functionalize the cache writes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32 or x.device.type != "cpu":
        # PyTorch's own: one fused kernel on GPUs, the reference's ops in the reference's
        # order on CPUs (bit-exact in float32).  In bf16/fp16 it applies the weight before
        # rounding, once, where the reference rounds twice: a rounding step apart at most,
        # so on CPUs, where no kernel is saved, the reference's order stays.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    dtype = x.dtype  # normalise in float32 like the reference, so bf16/fp16 match it
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    s = x + residual
    return rms_norm(s, weight, eps), s


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


def gelu_tanh_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """GeGLU with GELU's tanh approximation (transformers' "gelu_pytorch_tanh": Gemma)."""
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def gelu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """GeGLU with the exact (erf) GELU (transformers' "gelu")."""
    gate, up = gu.chunk(2, dim=-1)
    return F.gelu(gate) * up


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] rotated by `RotaryEmbedding.at`'s tables: the reference's x * cos +
    rotate_half(x) * sin, with rotate_half = cat(-x2, x1) and the sign moved into the table
    (x2 * -sin1 is (-x2) * sin1 exactly), in the reference's order and dtype, so bf16/fp16
    runs round the same way."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([x[..., half:], x[..., :half]], dim=-1) * signed_sin


def rope(q, k, positions, cos_table, sin_table, cs):
    """q [T, Hq, D] and k [T, Hk, D] rotated; `cs`: this step's tables (`RotaryEmbedding.at`)."""
    return rotate(q, *cs), rotate(k, *cs)


@dataclass(frozen=True)
class Ops:
    name: str
    rms_norm: Callable = rms_norm
    add_rms_norm: Callable = add_rms_norm
    silu_and_mul: Callable = silu_and_mul
    rope: Callable = rope
    rope_write_kv: Callable | None = None
    gelu_tanh_and_mul: Callable = gelu_tanh_and_mul  # no backend has its own yet: PyTorch's everywhere
    gelu_and_mul: Callable = gelu_and_mul

    def act_and_mul(self, act: str) -> Callable:
        """The gated MLP's activation-and-product for transformers' activation name `act`."""
        return {"silu": self.silu_and_mul, "gelu_pytorch_tanh": self.gelu_tanh_and_mul,
                "gelu": self.gelu_and_mul}[act]


TORCH = Ops("torch")


def cpu_ops_available(dtype: torch.dtype) -> bool:
    """Whether our C++ ops run for `dtype` here (model/backends.py asks, once)."""
    from tokenloom.kernels import cpu as cpu_kernels

    return dtype in (torch.float32, torch.bfloat16) and cpu_kernels.fused_enabled()


def _cpu_ops(dtype: torch.dtype) -> Ops:
    from tokenloom.kernels import cpu as cpu_kernels

    ops = torch.ops.tokenloom_cpu
    # SwiGLU on sixteen lanes where the AVX-512 extension runs (cpu_fused_avx512.cpp), else eight
    silu = torch.ops.tokenloom_avx512.silu_and_mul if cpu_kernels.avx512_enabled() else ops.silu_and_mul

    def cpu_rope(q, k, positions, cos_table, sin_table, cs):
        return ops.rope(q, k, positions, cos_table, sin_table)

    return Ops("cpu", rms_norm=ops.rms_norm, add_rms_norm=ops.add_rms_norm, silu_and_mul=silu,
               rope=cpu_rope if dtype == torch.float32 else rope,  # the rotary-only op is float32
               rope_write_kv=ops.rope_write_kv)


def _triton_ops(dtype: torch.dtype) -> Ops:
    from tokenloom.kernels.triton import fused

    if dtype not in (torch.float32, torch.bfloat16):
        return Ops("triton", rope_write_kv=fused.rope_write_kv)
    return Ops("triton", rms_norm=fused.rms_norm, add_rms_norm=fused.add_rms_norm, silu_and_mul=fused.silu_and_mul,
               rope_write_kv=fused.rope_write_kv)


def build_ops(name: str, dtype: torch.dtype, fused_kv_write: bool) -> Ops:
    """The ops set `name` for `dtype`, as the backend plan (model/backends.py) resolved it:
    nothing is chosen here.  Without `fused_kv_write` (torch.compile, which would
    functionalize the cache writes) the attention backend writes the cache itself."""
    ops = _cpu_ops(dtype) if name == "cpu" else _triton_ops(dtype) if name == "triton" else TORCH
    return ops if fused_kv_write else replace(ops, rope_write_kv=None)
