"""GPTQ checkpoints (AutoGPTQ, GPTQModel, optimum): `quant_method: gptq`.

Per linear layer, K inputs, N outputs, b bits (4 or 8), G groups:

    qweight  int32 [K * b / 32, N]   packed along K: word r of column n holds k = r * 32/b + t
                                      in bits [b * t, b * (t + 1))
    qzeros   int32 [G, N * b / 32]   packed along N the same way; `checkpoint_format` gptq (v1)
                                      stores zero - 1, gptq_v2 the zero itself
    scales   float16 [G, N]
    g_idx    int32 [K]               each input's group (desc_act reorders them; without it, k // group)

w[n, k] = (q[k, n] - z[g_idx[k], n]) * scales[g_idx[k], n].  `sym` only says how the zeros were
chosen (all at the midpoint); the stored zeros are read either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.model.weights.formats.checkpoint_format import (CheckpointFormat, group_setting, group_words,
                                                               int_setting, refuse)
from tokenloom.model.weights.formats.int_weight import IntWeight, unpack_int32

FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GPTQ(CheckpointFormat):
    bits: int
    group: int  # -1: one group per row
    desc_act: bool
    sym: bool
    v1: bool  # checkpoint_format gptq: qzeros hold zero - 1

    method = "gptq"
    primary = "qweight"
    tensors = frozenset({"qweight", "qzeros", "scales", "g_idx"})
    required = frozenset({"qweight", "qzeros", "scales"})

    def describe(self) -> str:
        return (f"gptq int{self.bits} {group_words(self.group)}{', desc_act' if self.desc_act else ''}, "
                f"{'symmetric' if self.sym else 'zero points'} ({'v1' if self.v1 else 'v2'} zeros)")

    def read(self, tensors: dict[str, torch.Tensor], module: str) -> IntWeight:
        self.check_complete(tensors, module)
        qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
        g_idx = tensors.get("g_idx")
        b = self.bits
        k = g_idx.numel() if g_idx is not None else qweight.shape[0] * 32 // b
        n = qweight.shape[1]
        codes = unpack_int32(qweight, b, 0, k).t().contiguous()
        zeros = unpack_int32(qzeros, b, 1, n).to(torch.int16)
        if self.v1:
            zeros += 1
        return IntWeight(bits=b, codes=codes, scales=scales.t().contiguous(), zeros=zeros.t().contiguous(),
                         group=k if self.group == -1 else self.group, g_idx=g_idx)


def parse(qc: dict) -> GPTQ:
    bits = int_setting(qc, "bits", 4)
    if bits not in (4, 8):
        raise refuse("bits", bits, "GPTQ checkpoints are read in 4 or 8 bits")
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if fmt not in FORMATS:
        key = "checkpoint_format" if qc.get("checkpoint_format") else "format"
        raise refuse(key, fmt, f"GPTQ checkpoints are read in the {' and '.join(FORMATS)} layouts")
    if qc.get("dynamic"):
        raise refuse("dynamic", "{...}", "per-module overrides of bits and group size are not supported")
    return GPTQ(bits=bits, group=group_setting(qc, "group_size", 128), desc_act=bool(qc.get("desc_act", False)),
                sym=bool(qc.get("sym", True)), v1=fmt == "gptq")
