"""AWQ checkpoints (AutoAWQ, llm-compressor's AWQ export): `quant_method: awq`, the GEMM layout.

Per linear layer, K inputs, N outputs, 4 bits, G = K / group_size groups:

    qweight  int32 [K, N / 8]   packed along N, interleaved: word j of row k holds columns
                                 8j .. 8j + 7, column 8j + ORDER[t] in bits [4t, 4t + 4)
    qzeros   int32 [G, N / 8]   the zero points, packed as qweight (the zero itself)
    scales   float16 [G, N]

w[n, k] = (q[k, n] - z[k // group, n]) * scales[k // group, n].  The GEMV and llm-awq layouts
pack differently and are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.model.weights.formats.checkpoint_format import (CheckpointFormat, group_setting, group_words,
                                                               int_setting, refuse)
from tokenloom.model.weights.formats.int_weight import IntWeight, unpack_int32

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # field t of a word holds column ORDER[t] of its eight


@dataclass(frozen=True)
class AWQ(CheckpointFormat):
    group: int  # -1: one group per row

    method = "awq"
    primary = "qweight"
    tensors = frozenset({"qweight", "qzeros", "scales"})
    required = tensors

    def describe(self) -> str:
        return f"awq int4 {group_words(self.group)}, zero points (gemm layout)"

    def read(self, tensors: dict[str, torch.Tensor], module: str) -> IntWeight:
        self.check_complete(tensors, module)
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        k, n = qweight.shape[0], scales.shape[1]
        codes = unpack_int32(qweight, 4, 1, n, ORDER).t().contiguous()
        zeros = unpack_int32(qzeros, 4, 1, n, ORDER).t().contiguous()
        return IntWeight(bits=4, codes=codes, scales=scales.t().contiguous(), zeros=zeros,
                         group=k if self.group == -1 else self.group)


def parse(qc: dict) -> AWQ:
    bits = int_setting(qc, "bits", 4, "w_bit")
    if bits != 4:
        raise refuse("bits", bits, "AWQ checkpoints are read in 4 bits (the GEMM layout packs no other)")
    version = str(qc.get("version") or qc.get("format") or "gemm").lower()
    if version != "gemm":
        key = "version" if qc.get("version") else "format"
        raise refuse(key, version, "AWQ checkpoints are read in the gemm layout (gemv, gemv_fast and llm-awq "
                                   "pack their words differently)")
    if qc.get("zero_point", True) is not True:
        raise refuse("zero_point", qc.get("zero_point"), "AWQ's gemm layout is read with its zero points")
    return AWQ(group=group_setting(qc, "group_size", 128, "q_group_size"))
