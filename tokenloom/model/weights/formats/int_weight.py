"""One pre-quantized linear weight in the terms every integer format shares, and the unpacking of
the int32 words those formats store it in.

GPTQ, AWQ and compressed-tensors each pack differently, but each describes the same matrix:

    w[n, k] = (codes[n, k] - zeros[n, g(k)]) * scales[n, g(k)]

with integer codes of `bits` bits (0 .. 2^bits - 1), one scale and one zero point per output row
and group of inputs, and g(k) = k // group unless the checkpoint reorders its inputs (GPTQ's
desc_act: a `g_idx` naming each input's group).  A symmetric weight's zero point is the
midpoint 2^(bits - 1).  Each format's reader (gptq.py, awq.py, compressed_tensors.py) unpacks
its tensors into an `IntWeight`; formats/to_kernels.py maps that onto our kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def unpack_int32(words: torch.Tensor, bits: int, dim: int, count: int,
                 order: list[int] | None = None) -> torch.Tensor:
    """The `bits`-bit fields of int32 `words` packed along `dim`, as uint8, `count` of them along
    `dim` (packing pads the last word).  Field t of a word sits at bits [bits * t, bits * (t + 1));
    `order[t]`, where given, is the position within its word's run the field holds (AWQ's
    interleave), else t."""
    per = 32 // bits
    w = words.movedim(dim, -1).to(torch.int32)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=w.device)
    fields = (w.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, per]
    if order is not None:
        inverse = [0] * per
        for t, pos in enumerate(order):
            inverse[pos] = t
        fields = fields[..., inverse]
    out = fields.flatten(-2)[..., :count].to(torch.uint8)
    if out.shape[-1] != count:
        raise ValueError(f"{words.shape[dim]} packed words hold {out.shape[-1]} values, not {count}")
    return out.movedim(-1, dim)


@dataclass
class IntWeight:
    """A quantized [N, K] matrix as its checkpoint defines it (see the module doc)."""

    bits: int
    codes: torch.Tensor  # uint8 [N, K], 0 .. 2^bits - 1
    scales: torch.Tensor  # [N, G] in the checkpoint's float dtype
    zeros: torch.Tensor | None  # int16 [N, G]; None: symmetric (the midpoint)
    group: int  # inputs per group (K: one group per row)
    g_idx: torch.Tensor | None = None  # int64 [K], each input's group; None: k // group

    def __post_init__(self) -> None:
        n, k = self.codes.shape
        groups = -(-k // self.group)
        if tuple(self.scales.shape) != (n, groups):
            raise ValueError(f"scales of shape {tuple(self.scales.shape)} for a [{n}, {k}] weight in groups of "
                             f"{self.group}: expected [{n}, {groups}]")
        if self.zeros is not None:
            if tuple(self.zeros.shape) != (n, groups):
                raise ValueError(f"zero points of shape {tuple(self.zeros.shape)}, expected [{n}, {groups}]")
            self.zeros = self.zeros.to(torch.int16)
            if bool((self.zeros == self.midpoint).all()):  # stored, but symmetric (GPTQ's sym=True)
                self.zeros = None
        if self.g_idx is not None:
            g = self.g_idx.to(torch.int64)
            if g.shape != (k,) or int(g.min()) < 0 or int(g.max()) >= groups:
                raise ValueError(f"g_idx must give each of the {k} inputs a group in 0..{groups - 1}")
            # an input order that is the natural one (every GPTQ checkpoint stores g_idx) is dropped
            self.g_idx = None if torch.equal(g, torch.arange(k) // self.group) else g

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    @property
    def midpoint(self) -> int:
        return 1 << (self.bits - 1)

    def zero_points(self) -> torch.Tensor:
        """int16 [N, G], the midpoint where the weight is symmetric."""
        if self.zeros is not None:
            return self.zeros
        return torch.full(tuple(self.scales.shape), self.midpoint, dtype=torch.int16)

    def input_groups(self) -> torch.Tensor:
        """int64 [K]: the group of each input."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.codes.shape[1]) // self.group

    def dequantize(self) -> torch.Tensor:
        """float32 [N, K], each product exact (integer times the scale, in float32)."""
        g = self.input_groups()
        z = self.zero_points().to(torch.float32)[:, g]
        return (self.codes.to(torch.float32) - z) * self.scales.to(torch.float32)[:, g]


def concat_rows(parts: list[IntWeight]) -> IntWeight | None:
    """Several weights that read the same input (q, k, v; gate, up) as one, stacked along N; None
    where the parts order their inputs differently (desc_act with different g_idx: no one
    reordering of the input serves them all).  They must agree on bits, K and group; scales of
    different dtypes meet in float32, and a symmetric part beside an asymmetric one gets its
    midpoint as zero points."""
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    for p in parts[1:]:
        if (p.bits, p.shape[1], p.group) != (first.bits, first.shape[1], first.group):
            raise ValueError(f"fused projections disagree on (bits, inputs, group): {(p.bits, p.shape[1], p.group)} "
                             f"vs {(first.bits, first.shape[1], first.group)}")
    orders = [p.g_idx for p in parts]
    if not (all(o is None for o in orders)
            or (all(o is not None for o in orders) and all(torch.equal(orders[0], o) for o in orders[1:]))):
        return None
    dtypes = {p.scales.dtype for p in parts}
    sdtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    return IntWeight(
        bits=first.bits,
        codes=torch.cat([p.codes for p in parts]),
        scales=torch.cat([p.scales.to(sdtype) for p in parts]),
        zeros=None if all(p.zeros is None for p in parts) else torch.cat([p.zero_points() for p in parts]),
        group=first.group,
        g_idx=orders[0],
    )
