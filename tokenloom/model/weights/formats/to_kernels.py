"""A checkpoint's quantized weight (`IntWeight`) onto our int4 / int8 kernels, bit for bit where
the layouts meet, dequantized at load where they do not.

Our kernels (model/weights/quantization.py) multiply by

    int4:  (q - 8) * s[n, k // G]   q in 0..15, G in {32, 64, 128}, s bf16 (fp16 where the kernel takes it)
    int8:  q * s[n]                 q in -128..127, one float32 scale per row

A checkpoint maps onto them without any value changing when:

* its group is a multiple of 32 (or the whole row): each of its scales is repeated over the
  kernel's groups inside it (a per-row int4 scale over groups of 128);
* its scales are in a dtype the kernel holds exactly: bf16 always; fp16 (GPTQ's, AWQ's) where
  the kernel reads fp16 scales (`kernel_takes_fp16_scales`); float32 scales that are exactly
  bf16 or fp16 values;
* int8: one group per row (its float scales widen to float32 exactly).

Two things the kernels lack are added around them, exactly:

* zero points (AWQ, GPTQ sym=False, compressed-tensors asymmetric): with z != 8,
  (q - z) s = (q - 8) s + (8 - z) s, so y = kernel(x) + sum_g (sum_{k in g} x_k) (8 - z_g) s_g:
  the per-group sums of x times a float32 correction matrix [N, G] -- which our int4 kernel adds
  itself as per-group offsets (`linear_int4`'s `offsets`), and which is added around int8 and the
  PyTorch path (`Prequantized`);
* desc_act's input order (g_idx): sorting the inputs by group makes each group contiguous, so
  the columns are permuted once at load and each x is gathered in that order per call.

Anything else (a group not a multiple of 32, int8 in groups, scales the kernel cannot hold,
parts of a fused projection ordered differently) is dequantized at load into the model's
dtype and runs as a dense linear.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenloom.model.weights.formats.int_weight import IntWeight, concat_rows
from tokenloom.model.weights.quant_schemes import QuantScheme
from tokenloom.model.weights.quantization import PanelQuantized, QuantizedMatrix, TorchQuantized

KERNEL_GROUPS = (128, 64, 32)


@dataclass
class Mapped:
    """How one linear layer will run: `matrix` on our kernels, or `dense` (dequantized), and why."""

    matrix: QuantizedMatrix | None
    dense: torch.Tensor | None
    why: str  # in words: "int4 kernel, groups of 128 (checkpoint 128), float16 scales, zero points"


def map_weight(parts: list[IntWeight], *, panels: bool, dtype: torch.dtype) -> Mapped:
    """The parts of one of our linears (q, k, v of a fused projection, or one weight) as it will
    run: `panels`, our CPU kernel, else the PyTorch path (which holds any scale dtype)."""
    fused = concat_rows(parts)
    if fused is None:
        return _dense(parts, "the fused projections order their inputs differently (g_idx)", dtype)
    w, perm = fused, None
    if fused.g_idx is not None:
        perm = torch.argsort(fused.g_idx, stable=True)
        if not torch.equal(fused.g_idx[perm], torch.arange(fused.shape[1]) // fused.group):
            return _dense([fused], "g_idx groups are not all of the group size", dtype)
        w = IntWeight(bits=w.bits, codes=w.codes[:, perm].contiguous(), scales=w.scales, zeros=w.zeros, group=w.group)
    layout = _int8(w) if w.bits == 8 else _int4(w, panels)
    if isinstance(layout, str):  # what keeps it off our kernels
        return _dense([fused], layout, dtype)
    q, s, scheme, why = layout
    correction = None
    if w.zeros is not None:  # (midpoint - z) * s per row and group, exact in float32
        correction = (w.midpoint - w.zeros.to(torch.float32)) * w.scales.to(torch.float32)
        why += ", zero points"
    if panels and w.bits == 4 and correction is not None and perm is None and not _amx_int4():
        # our int4 kernel adds them itself: the correction as a per-group offset, repeated over
        # the kernel's groups inside each checkpoint group (or the whole row), as the scales are
        # (where the AMX int4 kernel runs, which takes no offsets, they stay around it)
        per = s.shape[1] if correction.shape[1] == 1 else w.group // scheme.group
        offsets = correction.repeat_interleave(per, dim=1)[:, : s.shape[1]].contiguous()
        return Mapped(PanelQuantized.from_quantized(q, s, scheme, w.shape[1], offsets=offsets), None, why)
    inner = (PanelQuantized if panels else TorchQuantized).from_quantized(q, s, scheme, w.shape[1])
    if correction is None and perm is None:
        return Mapped(inner, None, why)
    if perm is not None:
        why += ", inputs reordered (g_idx)"
    return Mapped(Prequantized(inner, perm, correction, w.group), None, why)


Layout = tuple[torch.Tensor, torch.Tensor, QuantScheme, str]  # q, scales, our scheme, in words


def _amx_int4() -> bool:
    """Whether 16-bit-scale int4 matrices may run on the AMX kernel here (kernels/amx.py)."""
    from tokenloom.kernels import amx as amx_kernels

    return amx_kernels.enabled()


def _int4(w: IntWeight, panels: bool) -> Layout | str:
    """Our int4 kernel's q and scales for `w` (zero points aside), or why not."""
    n, k = w.shape
    whole_row = w.group >= k
    kg = next((g for g in KERNEL_GROUPS if whole_row or w.group % g == 0), None)
    if kg is None:
        return f"group {w.group} is not a multiple of 32"
    scales = _kernel_scales(w.scales, panels)
    if scales is None:
        return f"our int4 kernel cannot hold {str(w.scales.dtype).removeprefix('torch.')} scales exactly"
    kp = -(-k // kg) * kg
    q = F.pad(w.codes.to(torch.int8) - 8, (0, kp - k))  # padding: code 8, a zero weight
    s = scales.repeat_interleave(kp // kg if whole_row else w.group // kg, dim=1)[:, : kp // kg].contiguous()
    why = (f"int4 kernel, groups of {kg} ({'per row' if whole_row else f'checkpoint {w.group}'}), "
           f"{str(s.dtype).removeprefix('torch.')} scales")
    return q, s, QuantScheme(f"int4-g{kg}", 4, kg), why


def _int8(w: IntWeight) -> Layout | str:
    """Our int8 kernel's q and scales for `w` (zero points aside), or why not."""
    if w.scales.shape[1] != 1:
        return f"int8 in groups of {w.group}: our int8 kernel has one scale per row"
    q = (w.codes.to(torch.int16) - 128).to(torch.int8)
    return q, w.scales[:, 0].float(), QuantScheme("int8", 8, 0), "int8 kernel, one scale per row"


def _dense(parts: list[IntWeight], why: str, dtype: torch.dtype) -> Mapped:
    return Mapped(None, torch.cat([p.dequantize() for p in parts]).to(dtype), f"dequantized at load: {why}")


def _exact(s: torch.Tensor, dtype: torch.dtype) -> bool:
    return bool(torch.equal(s.to(dtype).to(s.dtype), s))


def _kernel_scales(s: torch.Tensor, panels: bool) -> torch.Tensor | None:
    """The scales in a dtype our int4 matrix holds them exactly, or None."""
    if not panels:
        return s  # the PyTorch path widens any float dtype
    if s.dtype == torch.bfloat16:
        return s
    fp16 = kernel_takes_fp16_scales()
    if s.dtype == torch.float16:
        return s if fp16 else (s.to(torch.bfloat16) if _exact(s, torch.bfloat16) else None)
    if _exact(s, torch.bfloat16):
        return s.to(torch.bfloat16)
    if fp16 and _exact(s, torch.float16):
        return s.to(torch.float16)
    return None


def kernel_takes_fp16_scales() -> bool:
    """Whether our int4 kernel here reads float16 group scales (checked by running it once)."""
    from tokenloom.kernels import cpu as cpu_kernels

    return _takes_fp16(cpu_kernels.quant_ops())


@functools.cache
def _takes_fp16(ops) -> bool:
    from tokenloom.kernels import cpu as cpu_kernels

    if ops is None:
        return False
    q = torch.zeros(32, 32, dtype=torch.int8)
    q[:, 0] = 1
    s = torch.full((32, 1), 1 + 2.0**-10, dtype=torch.float16)  # not a bf16 value
    try:
        packed, ps = cpu_kernels.pack_int4(q, s)
        y = ops.linear_int4(torch.ones(1, 32), packed, ps, 32, 32, None)
    except RuntimeError:
        return False
    return bool(torch.equal(y, torch.full((1, 32), 1 + 2.0**-10)))


def group_sums(x: torch.Tensor, group: int, groups: int) -> torch.Tensor:
    """[..., K] -> float32 [..., groups]: the sum of x over each group of `group` inputs, in float32."""
    k = x.shape[-1]
    if groups == 1:
        return x.sum(-1, keepdim=True, dtype=torch.float32)
    if groups * group != k:
        x = F.pad(x, (0, groups * group - k))
    return x.unflatten(-1, (groups, group)).sum(-1, dtype=torch.float32)


class Prequantized(QuantizedMatrix):
    """A checkpoint's matrix on our kernel (`inner`), with what the kernel lacks added around it:
    its input order (`perm`: x is gathered to it) and zero points (`correction` [N, G] float32,
    multiplied by the per-group sums of x and added).  See the module doc for the algebra."""

    def __init__(self, inner: QuantizedMatrix, perm: torch.Tensor | None, correction: torch.Tensor | None,
                 group: int):
        super().__init__()
        self.inner = inner
        self.out_features, self.in_features, self.scheme = inner.out_features, inner.in_features, inner.scheme
        self.group = group
        self.register_buffer("perm", perm, persistent=False)
        self.register_buffer("correction", correction, persistent=False)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.correction is None:
            return self.inner.matmul(x, bias)
        x2 = x.reshape(-1, x.shape[-1])
        # The correction in float32: the group sums of x (summed in float32) times it.
        y = group_sums(x2, self.group, self.correction.shape[1]).mm(self.correction.t())
        # float32 x: one rounding, after the correction is added.  bfloat16 x goes to the kernel
        # as it is (its bf16 integer path at any row count, where float32 x above 8 rows widens
        # every weight: 1.7x slower at 16 rows), the correction added to its bf16 output.
        y.add_(self.inner.matmul(x2 if x.dtype == torch.bfloat16 else x2.float(), bias))
        return y.view(*x.shape[:-1], y.shape[-1]).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.inner.rows(ids)  # [..., K], inputs in the kernel's order
        if self.correction is not None:
            c = self.correction[ids]  # [..., G]
            # each group's correction over its inputs (expand, not repeat_interleave: a CPU graph
            # replays this lookup, and repeat_interleave counts its output on the host)
            w = w + c.unsqueeze(-1).expand(*c.shape, self.group).flatten(-2)[..., : self.in_features]
        if self.perm is not None:
            w = w.index_select(-1, torch.argsort(self.perm))
        return w
