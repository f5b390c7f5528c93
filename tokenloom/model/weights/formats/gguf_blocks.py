"""GGUF tensor types: which we read, and how each becomes our weights.

A GGUF tensor of a linear layer is [N rows, K] stored row by row, each row cut into blocks
along K.  What a block holds decides what we do with it:

    type    block (bytes)                          here
    Q4_0    32 w: fp16 d, 16 B of nibbles q        kept: int4, groups of 32, fp16 scales  w = (q - 8) d
    Q8_0    32 w: fp16 d, 32 int8 q                kept: int8, groups of 32, fp16 scales  w = q d
    Q5_0    32 w: fp16 d, 5-bit q                  kept: int8 groups as Q8_0 (q - 16 fits) w = (q - 16) d
    F32 F16 BF16                                   read as they are
    Q4_K    256 w: fp16 d, dmin; 8 x 6-bit sc, m;  kept: int4, groups of 32, fp32 scales s = d sc,
            128 B of nibbles q                     and fp32 offsets o = 8 s - dmin m per group:
                                                   w = (q - 8) s + o = q d sc - dmin m
    Q4_1 Q5_1 (fp16 d and min m: w = q d + m)      dequantized at load
    Q5_K Q6_K (256-w super-blocks, 6/8-bit         dequantized at load (gguf.quants.dequantize)
      sub-block scales; Q4_K_M / Q5_K_M mix them
      with Q4_K, Q5_0 and Q8_0)

"Kept" is exact: a block's integers and its float16 scale d go unchanged into our kernel's
group-of-32 layouts (model/weights/quantization.py `from_quantized`); float16 scales, not our
own int4's bfloat16, since float16 -> bfloat16 would round away three bits of every d.  Q5_0's
5-bit integers fit int8, so it runs as the int8 kernel at 8.5 bits a weight rather than 16 or
32.  Q4_K's sub-blocks are groups of 32 too: each one's scale d * sc (a float16 times a 6-bit
integer) is exact in float32, which the int4 kernel takes, and its min becomes a float32
offset per group that the kernel adds times the group's sum of x (`linear_int4`'s `offsets`):
4 bits a weight plus 64 per group of 32, 6 in all.  The other affine types (a
min per block) and K-quants (Q5_K's 5-bit integers with a min, Q6_K's groups of 16) are
dequantized once, in float32, and stored in the model's dtype like any unquantized checkpoint
(`--quantization` can then requantize them).
Every other type (Q2_K, Q3_K, the IQ and TQ families, MXFP4, ...) is refused at load, naming
the tensor and its type.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize

from tokenloom.model.weights.formats.gguf_file import GGUFTensor

T = GGMLQuantizationType

# Types whose integers and scales our kernels run as they are, and as which kernel.
KEPT: dict[GGMLQuantizationType, str] = {T.Q4_0: "int4", T.Q8_0: "int8", T.Q5_0: "int8", T.Q4_K: "int4"}
FLOAT = (T.F32, T.F16, T.BF16)
DEQUANTIZED = (T.Q4_1, T.Q5_1, T.Q5_K, T.Q6_K)
SUPPORTED = (*FLOAT, *KEPT, *DEQUANTIZED)
GROUP = 32  # weights per block of every kept type

_ROWS_PER_CHUNK = 4096  # rows decoded at a time: float32 temporaries stay small for big matrices


def describe_supported() -> str:
    """The supported types, in words, for error messages and docs."""
    return (f"{', '.join(t.name for t in FLOAT)} (as stored); {', '.join(t.name for t in KEPT)} (kept quantized); "
            f"{', '.join(t.name for t in DEQUANTIZED)} (dequantized at load)")


def check_type(tensor: GGUFTensor) -> None:
    """ValueError naming the tensor and its type where we cannot read it."""
    if tensor.tensor_type not in SUPPORTED:
        raise ValueError(f"GGUF tensor {tensor.name!r} is stored as {tensor.tensor_type.name}, which tokenloom does "
                         f"not read; supported tensor types: {describe_supported()}")


def _row_blocks(tensor: GGUFTensor) -> np.ndarray:
    """The raw bytes of a 2-D quantized tensor as [N, K / block, bytes per block]."""
    block, nbytes = GGML_QUANT_SIZES[tensor.tensor_type]
    n, k = tensor.shape
    return tensor.data.reshape(n, k // block, nbytes)


def q4_0_bytes(tensor: GGUFTensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 matrix [N, K] as its nibbles, uint8 [N, K / 32, 16] (byte j: element j low, j + 16
    high, each q + 8), and its float16 scales [N, K / 32]; `rows` reorders the rows."""
    b = _row_blocks(tensor)
    n, nb, _ = b.shape
    if rows is not None:
        b = b[rows.numpy()]
    # numpy: its copies of these strided byte views ran far faster than PyTorch's here
    return (torch.from_numpy(np.ascontiguousarray(b[..., 2:])),
            torch.from_numpy(np.ascontiguousarray(b[..., :2]).view(np.float16).reshape(n, nb)))


def kept_blocks(tensor: GGUFTensor, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A Q4_0 / Q8_0 / Q5_0 matrix [N, K] as (int8 q [N, K], float16 d [N, K / 32]) with
    w[n, k] = q[n, k] * d[n, k // 32] exactly; `rows` reorders the rows (q and d alike).
    (Q4_K, with a second number per group: `q4_k_groups`.)"""
    qtype = tensor.tensor_type
    if qtype not in KEPT or qtype == T.Q4_K:
        raise ValueError(f"{tensor.name}: {qtype.name} is not a kept type")
    b = _row_blocks(tensor)
    n, nb, _ = b.shape
    d = torch.from_numpy(np.array(b[..., :2]).view(np.float16).reshape(n, nb))
    if qtype == T.Q8_0:
        q = torch.from_numpy(np.array(b[..., 2:]).view(np.int8).reshape(n, nb * GROUP))
    elif qtype == T.Q4_0:  # byte j: element j in its low nibble, element j + 16 in its high one
        qs = torch.from_numpy(np.array(b[..., 2:]))
        q = (torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.int8) - 8).reshape(n, nb * GROUP)
    else:  # Q5_0: the format's own dequantizer gives w = (q - 16) d; q is w / d, exactly
        q = torch.empty((n, nb * GROUP), dtype=torch.int8)
        for r0 in range(0, n, _ROWS_PER_CHUNK):
            r1 = min(n, r0 + _ROWS_PER_CHUNK)
            w = torch.from_numpy(dequantize(tensor.data[r0:r1], qtype)).view(r1 - r0, nb, GROUP)
            dd = d[r0:r1].float()[..., None]
            q[r0:r1] = torch.where(dd != 0, w / torch.where(dd != 0, dd, 1), 0).round().to(torch.int8).view(r1 - r0, -1)
    if rows is not None:
        q, d = q[rows], d[rows]
    return q.contiguous(), d.contiguous()


def q4_k_groups(tensor: GGUFTensor, rows: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A Q4_K matrix [N, K] as (int8 q [N, K] in -8..7, float32 scales s [N, K / 32], float32
    offsets o [N, K / 32]) with w[n, k] = q s + o over each group of 32: q the stored nibble less
    8, s = d * sc, o = 8 s - dmin * m -- the sub-block scales and mins unpacked by the `gguf`
    package's own `Q4_K.get_scale_min`; `rows` reorders the rows."""
    block, nbytes = GGML_QUANT_SIZES[T.Q4_K]
    n, k = tensor.shape
    nb = k // block
    q = torch.empty((n, k), dtype=torch.int8)
    s = torch.empty((n, k // GROUP), dtype=torch.float32)
    o = torch.empty((n, k // GROUP), dtype=torch.float32)
    raw = tensor.data.reshape(n, nb * nbytes)
    for r0 in range(0, n, _ROWS_PER_CHUNK):
        r1 = min(n, r0 + _ROWS_PER_CHUNK)
        b = np.asarray(raw[r0:r1]).reshape(-1, nbytes)  # every super-block of these rows
        d = b[:, 0:2].copy().view(np.float16).astype(np.float32)
        dmin = b[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, m = Q4_K.get_scale_min(b[:, 4:4 + Q4_K.K_SCALE_SIZE])
        scale = d * sc.astype(np.float32)  # [blocks, 8], exact: an 11-bit by a 6-bit integer
        qs = b[:, 4 + Q4_K.K_SCALE_SIZE:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        nib = (qs & np.uint8(15)).reshape(r1 - r0, k)  # 64 weights a chunk: 32 low nibbles, then 32 high
        q[r0:r1] = torch.from_numpy(nib.astype(np.int8) - 8)
        s[r0:r1] = torch.from_numpy(scale.reshape(r1 - r0, -1))
        o[r0:r1] = torch.from_numpy((8 * scale - dmin * m.astype(np.float32)).reshape(r1 - r0, -1))
    if rows is not None:
        q, s, o = q[rows], s[rows], o[rows]
    return q.contiguous(), s.contiguous(), o.contiguous()


def dense(tensor: GGUFTensor, dtype: torch.dtype, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The tensor's values in `dtype` (quantized types dequantized in float32 first, a few
    thousand rows at a time); `rows` reorders the first dimension."""
    qtype = tensor.tensor_type
    dims = tensor.shape
    if qtype in FLOAT:
        if qtype == T.BF16:  # numpy has no bfloat16: the raw 16 bits, reinterpreted
            t = torch.from_numpy(np.array(tensor.data).view(np.int16)).view(torch.bfloat16)
        else:
            t = torch.from_numpy(np.array(tensor.data))
        out = t.reshape(dims).to(dtype)
    elif len(dims) == 1:
        out = torch.from_numpy(dequantize(tensor.data, qtype)).reshape(dims).to(dtype)
    else:
        n = dims[0]
        out = torch.empty(dims, dtype=dtype)
        raw = tensor.data
        for r0 in range(0, n, _ROWS_PER_CHUNK):
            r1 = min(n, r0 + _ROWS_PER_CHUNK)
            out[r0:r1] = torch.from_numpy(dequantize(raw[r0:r1], qtype)).reshape(r1 - r0, *dims[1:])
    return out if rows is None else out[rows].contiguous()
