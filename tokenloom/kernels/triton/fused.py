"""Fused small ops in Triton: one kernel where PyTorch launches several.

A decode step of a small model on a GPU is a few hundred tiny kernels; each of these
replaces a chain of them per layer:

- `add_rms_norm`: the residual add and the RMSNorm after it (PyTorch: add, pow, mean,
  add, rsqrt, mul, cast, mul);
- `silu_and_mul`: SwiGLU's activation, SiLU(gate) * up, reading the fused gate/up output;
- `rope_write_kv`: rotary embedding of q and k and the KV cache write, reading the fused
  qkv output (PyTorch: gathers, multiplies, a concatenation and two index copies);
- `write_kv`: the KV cache write alone (q/k norms come first, then rotary).

Each rounds where the reference implementation (transformers, in the model's dtype) rounds:
the residual sum is rounded before it is normalised, the normalised row is rounded before
the weight multiplies it, SiLU's output is rounded before the product, and rotary's two
products are rounded before their sum.  A slot of -1 (a padded row) writes nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, n, eps,
                     stride_x, stride_r, stride_o, stride_ro,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)  # rounded to the dtype
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, 0) / n
    y = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w.to(tl.float32) * y.to(tl.float32)).to(out_ptr.dtype.element_ty),
             mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, in the reference's roundings."""
    x2 = _rows(x)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, x2, weight, out, out, x2.shape[1], eps,
                                         x2.stride(0), 0, out.stride(0), 0,
                                         HAS_RES=False, BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """(rms_norm(x + residual), x + residual) in one pass over [T, hidden] rows."""
    x2, r2 = _rows(x), _rows(residual)
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    res = torch.empty_like(out)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, r2, weight, out, res, x2.shape[1], eps,
                                         x2.stride(0), r2.stride(0), out.stride(0), res.stride(0),
                                         HAS_RES=True, BLOCK=triton.next_power_of_2(x2.shape[1]))
    return out.view(x.shape), res.view(x.shape)


@triton.jit
def _silu_and_mul_kernel(gu_ptr, out_ptr, n, stride_gu, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(gu_ptr + row * stride_gu + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * stride_gu + n + cols, mask=mask, other=0.0)
    act = (g / (1.0 + tl.exp(-g))).to(u.dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * u.to(tl.float32)).to(u.dtype), mask=mask)


def silu_and_mul(gu: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> [T, I] = SiLU(gate) * up."""
    gu2 = _rows(gu)
    n = gu2.shape[1] // 2
    out = torch.empty((gu2.shape[0], n), dtype=gu.dtype, device=gu.device)
    if gu2.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_and_mul_kernel[(gu2.shape[0], triton.cdiv(n, block))](gu2, out, n, gu2.stride(0), out.stride(0),
                                                                     BLOCK=block)
    return out.view(*gu.shape[:-1], n)


@triton.jit
def _rotate_half(x1, x2, c, s, dtype: tl.constexpr):
    """(x1, x2) rotated: x1*c - x2*s and x2*c + x1*s, each product rounded to `dtype`."""
    a1 = (x1 * c).to(dtype).to(tl.float32)
    b1 = (-x2 * s).to(dtype).to(tl.float32)
    a2 = (x2 * c).to(dtype).to(tl.float32)
    b2 = (x1 * s).to(dtype).to(tl.float32)
    return (a1 + b1).to(dtype), (a2 + b2).to(dtype)


@triton.jit
def _rope_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_out, k_cache, v_cache,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_cs,
    stride_ot, stride_oh, stride_cache_slot, stride_cache_h,
    HQ: tl.constexpr, HK: tl.constexpr, H_PAD: tl.constexpr, HALF: tl.constexpr, HALF_PAD: tl.constexpr,
    ROTATE: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, HALF_PAD)
    dmask = d < HALF
    slot = tl.load(slot_ptr + t).to(tl.int64)
    kmask = (h < HK)[:, None] & dmask[None, :]
    k1 = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=kmask, other=0.0)
    k2 = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + HALF + d[None, :], mask=kmask, other=0.0)
    dtype = k1.dtype
    if ROTATE:
        pos = tl.load(pos_ptr + t)
        # the tables in the model's dtype, as the reference casts them
        c = tl.load(cos_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
        s = tl.load(sin_ptr + pos * stride_cs + d, mask=dmask, other=0.0).to(dtype).to(tl.float32)[None, :]
        qmask = (h < HQ)[:, None] & dmask[None, :]
        q1 = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + d[None, :], mask=qmask, other=0.0)
        q2 = tl.load(q_ptr + t * stride_qt + h[:, None] * stride_qh + HALF + d[None, :], mask=qmask, other=0.0)
        r1, r2 = _rotate_half(q1.to(tl.float32), q2.to(tl.float32), c, s, dtype)
        tl.store(q_out + t * stride_ot + h[:, None] * stride_oh + d[None, :], r1, mask=qmask)
        tl.store(q_out + t * stride_ot + h[:, None] * stride_oh + HALF + d[None, :], r2, mask=qmask)
        k1, k2 = _rotate_half(k1.to(tl.float32), k2.to(tl.float32), c, s, dtype)
    if slot >= 0:
        base = k_cache + slot * stride_cache_slot + h[:, None] * stride_cache_h + d[None, :]
        tl.store(base, k1.to(k_cache.dtype.element_ty), mask=kmask)
        tl.store(base + HALF, k2.to(k_cache.dtype.element_ty), mask=kmask)
        v1 = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=kmask, other=0.0)
        v2 = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + HALF + d[None, :], mask=kmask, other=0.0)
        vbase = v_cache + slot * stride_cache_slot + h[:, None] * stride_cache_h + d[None, :]
        tl.store(vbase, v1.to(v_cache.dtype.element_ty), mask=kmask)
        tl.store(vbase + HALF, v2.to(v_cache.dtype.element_ty), mask=kmask)


def _launch_rope_kv(q, k, v, positions, cos, sin, slots, k_cache, v_cache, q_out, rotate: bool) -> None:
    t, hk, dim = k.shape
    hq = q.shape[1]
    assert dim % 2 == 0 and k_cache.stride(1) == k_cache.shape[2] * k_cache.stride(2)
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1
    if t == 0:
        return
    _rope_write_kv_kernel[(t,)](
        q, k, v, positions, cos, sin, slots, q_out, k_cache, v_cache,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), cos.stride(0),
        q_out.stride(0), q_out.stride(1), k_cache.stride(1), k_cache.stride(2),
        HQ=hq, HK=hk, H_PAD=triton.next_power_of_2(max(hq, hk)), HALF=dim // 2,
        HALF_PAD=triton.next_power_of_2(dim // 2), ROTATE=rotate,
    )


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                  num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """From the fused qkv output [T, (Hq + 2 Hk) * D]: rotate q and k by `positions` (cos/sin:
    the model's [max_positions, D] tables, rotate-half layout), write k and v to the cache at
    `slot_mapping` (-1: skipped), and return the rotated q [T, Hq, D]."""
    t = qkv.shape[0]
    dim = k_cache.shape[3]
    heads = qkv.view(t, num_heads + 2 * num_kv_heads, dim)
    q, k, v = heads[:, :num_heads], heads[:, num_heads:num_heads + num_kv_heads], heads[:, num_heads + num_kv_heads:]
    q_out = torch.empty((t, num_heads, dim), dtype=qkv.dtype, device=qkv.device)
    _launch_rope_kv(q, k, v, positions, cos, sin, slot_mapping, k_cache, v_cache, q_out, rotate=True)
    return q_out


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write k and v ([T, Hk, D]) to the paged cache at `slot_mapping` (-1: skipped)."""
    _launch_rope_kv(k, k, v, slot_mapping, k, k, slot_mapping, k_cache, v_cache, k, rotate=False)
