"""An independent GPTQ / AWQ packer for tests, written from the formats' published layouts (the
AutoGPTQ and AutoAWQ QuantLinear `pack` methods' documented results), not from our reader.

`quantize` chooses codes, scales and zero points per group the way GPTQ's and AWQ's quantizers
do (round to nearest on min/max, no calibration: the layout is what is under test); the packers
write them as the libraries do; `reference` is the dequantized weight computed here, in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # AutoAWQ gemm: field i of a word holds column AWQ_ORDER[i]


@dataclass
class Quantized:
    codes: torch.Tensor  # int64 [N, K] in 0 .. 2^bits - 1
    scales: torch.Tensor  # float16 [G, N]
    zeros: torch.Tensor  # int64 [G, N]
    g_idx: torch.Tensor  # int64 [K]
    bits: int

    def reference(self) -> torch.Tensor:
        """float32 [N, K]: (code - zero) * scale of each input's group."""
        z = self.zeros.t()[:, self.g_idx].double()
        s = self.scales.t()[:, self.g_idx].double()
        return ((self.codes.double() - z) * s).float()


def quantize(w: torch.Tensor, bits: int, group: int, sym: bool, order: torch.Tensor | None = None,
             min_zero: int = 0) -> Quantized:
    """`w` [N, K] in groups of `group` inputs (-1: the row) taken in `order` (a permutation of
    the inputs: GPTQ's desc_act; None: natural order).  Scales are rounded to float16 first and
    the codes chosen against the rounded scales, as the libraries store them."""
    n, k = w.shape
    group = k if group == -1 else group
    order = torch.arange(k) if order is None else order
    g_idx = torch.empty(k, dtype=torch.int64)
    g_idx[order] = torch.arange(k) // group
    groups = -(-k // group)
    maxq = 2 ** bits - 1
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    codes = torch.empty(n, k, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().squeeze(1)
        wg = w[:, cols].double()
        lo, hi = wg.amin(1).clamp(max=0), wg.amax(1).clamp(min=0)
        if sym:
            hi = torch.maximum(lo.abs(), hi)
            lo = -hi
        s = ((hi - lo) / maxq).clamp(min=1e-6).half()
        z = torch.full((n,), (maxq + 1) // 2, dtype=torch.int64) if sym else \
            torch.round(-lo / s.double()).long().clamp(min_zero, maxq)
        scales[g], zeros[g] = s, z
        codes[:, cols] = torch.clamp(torch.round(wg / s.double()[:, None]).long() + z[:, None], 0, maxq)
    return Quantized(codes, scales, zeros, g_idx, bits)


def _int32(v: torch.Tensor) -> torch.Tensor:
    """uint32 bit patterns held in int64 -> the int32 tensor with those bits."""
    return (((v & 0xFFFFFFFF) + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def _pack_rows(v: torch.Tensor, bits: int, order: list[int] | None = None) -> torch.Tensor:
    """[R, C] values packed along R: word r of column c holds rows r*per .. r*per + per - 1,
    field i (bits [bits * i, ...)) holding row r*per + (order[i] if order else i)."""
    per = 32 // bits
    order = order or list(range(per))
    out = torch.zeros(v.shape[0] // per, v.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= (v[order[i]::per] & (2 ** bits - 1)) << (bits * i)
    return _int32(out)


def pack_gptq(q: Quantized, v1: bool) -> dict[str, torch.Tensor]:
    """AutoGPTQ's buffers: qweight [K*b/32, N] packed along K, qzeros [G, N*b/32] packed along N
    (v1: zero - 1), scales [G, N] fp16, g_idx [K] int32."""
    zeros = q.zeros - 1 if v1 else q.zeros
    return {"qweight": _pack_rows(q.codes.t(), q.bits),
            "qzeros": _pack_rows(zeros.t(), q.bits).t().contiguous(),
            "scales": q.scales.clone(), "g_idx": q.g_idx.to(torch.int32)}


def pack_awq(q: Quantized) -> dict[str, torch.Tensor]:
    """AutoAWQ gemm's buffers: qweight [K, N/8] and qzeros [G, N/8] packed along N in the
    interleaved order, scales [G, N] fp16."""
    return {"qweight": _pack_rows(q.codes, 4, AWQ_ORDER).t().contiguous(),
            "qzeros": _pack_rows(q.zeros.t(), 4, AWQ_ORDER).t().contiguous(),
            "scales": q.scales.clone()}
