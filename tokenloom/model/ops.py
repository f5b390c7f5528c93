"""The model's small ops (norms, rotary, SwiGLU's activation), one implementation set
chosen once at load: the *ops backend*.

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

OPS_BACKENDS = ("auto", "torch", "cpu", "triton")


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


TORCH = Ops("torch")


def _cpu_ops(dtype: torch.dtype) -> Ops | None:
    from tokenloom.kernels import cpu as cpu_kernels

    if dtype not in (torch.float32, torch.bfloat16) or not cpu_kernels.fused_enabled():
        return None
    ops = torch.ops.tokenloom_cpu

    def cpu_rope(q, k, positions, cos_table, sin_table, cs):
        return ops.rope(q, k, positions, cos_table, sin_table)

    return Ops("cpu", rms_norm=ops.rms_norm, add_rms_norm=ops.add_rms_norm, silu_and_mul=ops.silu_and_mul,
               rope=cpu_rope if dtype == torch.float32 else rope,  # the rotary-only op is float32
               rope_write_kv=ops.rope_write_kv)


def _triton_ops(dtype: torch.dtype) -> Ops:
    from tokenloom.kernels.triton import fused

    if dtype not in (torch.float32, torch.bfloat16):
        return Ops("triton", rope_write_kv=fused.rope_write_kv)
    return Ops("triton", rms_norm=fused.rms_norm, add_rms_norm=fused.add_rms_norm, silu_and_mul=fused.silu_and_mul,
               rope_write_kv=fused.rope_write_kv)


def choose_ops(name: str, device: torch.device, dtype: torch.dtype, attention_backend: str,
               compile: bool = False) -> Ops:
    """The ops set for `--ops-backend name`: `auto` follows the attention backend (triton
    with triton; our C++ ops on CPUs where they build; PyTorch's elsewhere)."""
    if name not in OPS_BACKENDS:
        raise ValueError(f"--ops-backend must be one of {', '.join(OPS_BACKENDS)}, got {name!r}")
    if name == "auto":
        if attention_backend == "triton":
            name = "triton"
        elif device.type == "cpu" and _cpu_ops(dtype) is not None:
            name = "cpu"
        else:
            name = "torch"
    if name == "triton" and attention_backend != "triton":
        raise ValueError("--ops-backend triton writes the KV cache the triton attention backend reads; "
                         "use it with --attention-backend triton")
    if name == "cpu":
        ops = _cpu_ops(dtype) if device.type == "cpu" else None
        if ops is None:
            raise ValueError("--ops-backend cpu needs --device cpu, float32 or bfloat16 and our CPU kernels built "
                             "(TOKENLOOM_CPU_FUSED not 0)")
    else:
        ops = _triton_ops(dtype) if name == "triton" else TORCH
    if compile:
        ops = replace(ops, rope_write_kv=None)
    return ops
