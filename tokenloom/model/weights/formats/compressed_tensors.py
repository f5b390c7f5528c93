"""compressed-tensors checkpoints (llm-compressor's): `quant_method: compressed-tensors`, weight-only
integers in the `pack-quantized` format (W4A16, W8A16, with or without zero points).

Per linear layer, N outputs, K inputs, b bits (4 or 8), G groups (1 for strategy "channel"):

    weight_packed      int32 [N, ceil(K * b / 32)]  packed along K: field t of a word at bits
                                                     [b * t, b * (t + 1)), each value q + 2^(b-1)
    weight_scale       [N, G] in the model's dtype
    weight_zero_point  int32 [ceil(N * b / 32), G]  packed along N (older writers: int8 [N, G]),
                                                     only when asymmetric
    weight_shape       int [2]: N, K
    weight_g_idx       int [K], only from activation ordering "group" (older writers)

w[n, k] = (q[n, k] - z[n, g(k)]) * s[n, g(k)], q and z as signed values (the offsets cancel).
Activation quantization (W8A8, W4A8...), float formats (fp8, nvfp4, mxfp4), sparsity and
transforms are refused, each naming its key.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.model.weights.formats.checkpoint_format import CheckpointFormat, group_words, refuse
from tokenloom.model.weights.formats.int_weight import IntWeight, unpack_int32

PACKED = "pack-quantized"
STRATEGIES = ("group", "channel")


@dataclass(frozen=True)
class WeightScheme:
    """One config group's weights: `bits`, and inputs per group (-1: strategy channel)."""

    bits: int
    group: int
    symmetric: bool


@dataclass(frozen=True)
class CompressedTensors(CheckpointFormat):
    schemes: tuple[WeightScheme, ...]

    method = "compressed-tensors"
    primary = "weight_packed"
    tensors = frozenset({"weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx"})
    required = frozenset({"weight_packed", "weight_scale", "weight_shape"})

    def describe(self) -> str:
        return "compressed-tensors pack-quantized " + "; ".join(
            f"int{s.bits} {group_words(s.group)}, {'symmetric' if s.symmetric else 'zero points'}"
            for s in self.schemes)

    def read(self, tensors: dict[str, torch.Tensor], module: str) -> IntWeight:
        self.check_complete(tensors, module)
        packed, scale = tensors["weight_packed"], tensors["weight_scale"]
        n, k = (int(v) for v in tensors["weight_shape"].tolist())
        if scale.dim() != 2 or scale.shape[0] != n:
            raise ValueError(f"{module}.weight_scale has shape {tuple(scale.shape)}; expected [{n}, groups]")
        scheme = self._scheme_of(module, packed.shape[1], k, scale.shape[1])
        codes = unpack_int32(packed, scheme.bits, 1, k)
        zeros = None
        zp = tensors.get("weight_zero_point")
        if zp is not None:
            if zp.dtype == torch.int32 and zp.shape[0] == -(-n * scheme.bits // 32):
                zeros = unpack_int32(zp, scheme.bits, 0, n).to(torch.int16)  # offset like the values
            else:  # unpacked signed zero points
                zeros = zp.reshape(n, -1).to(torch.int16) + (1 << (scheme.bits - 1))
        return IntWeight(bits=scheme.bits, codes=codes, scales=scale, zeros=zeros,
                         group=k if scheme.group == -1 else scheme.group, g_idx=tensors.get("weight_g_idx"))

    def _scheme_of(self, module: str, words: int, k: int, groups: int) -> WeightScheme:
        """Which config group wrote this layer, told apart by its tensors' shapes (the config
        names its layers by targets, which would need the whole module tree to match)."""
        fits = [s for s in self.schemes if -(-k * s.bits // 32) == words
                and groups == (1 if s.group == -1 else -(-k // s.group))]
        if len({(s.bits, s.group) for s in fits}) != 1:
            raise ValueError(f"{module}: weight_packed with {words} words per row and {groups} scale groups over {k} "
                             f"inputs fits {'none' if not fits else 'more than one'} of the config's weight schemes")
        return fits[0]


def _weights(name: str, grp: dict, default_format: str | None) -> WeightScheme:
    key = f"config_groups.{name}"
    fmt = grp.get("format") or default_format
    if fmt != PACKED:
        raise refuse(f"{key}.format", fmt, f"compressed-tensors checkpoints are read in the {PACKED} format "
                                           "(integer weights only)")
    for act in ("input_activations", "output_activations"):
        if grp.get(act):
            raise refuse(f"{key}.{act}", "{...}", "activation quantization (W8A8, W4A8) is not supported: "
                                                  "weight-only (W4A16, W8A16) checkpoints are")
    w = grp.get("weights")
    if not w:
        raise refuse(f"{key}.weights", w, "a config group without weights has nothing to read")
    if w.get("type", "int") != "int":
        raise refuse(f"{key}.weights.type", w.get("type"), "float formats (fp8, fp4) are not supported: integer "
                                                           "weights are")
    bits = w.get("num_bits", 8)
    if bits not in (4, 8):
        raise refuse(f"{key}.weights.num_bits", bits, "integer weights are read in 4 or 8 bits")
    strategy = w.get("strategy") or "tensor"
    if strategy not in STRATEGIES:
        raise refuse(f"{key}.weights.strategy", strategy, f"weights are read with strategy {' or '.join(STRATEGIES)}")
    if w.get("dynamic"):
        raise refuse(f"{key}.weights.dynamic", w.get("dynamic"), "weights must be quantized in the checkpoint")
    if w.get("block_structure"):
        raise refuse(f"{key}.weights.block_structure", w.get("block_structure"), "block scales are not supported")
    group = -1
    if strategy == "group":
        group = w.get("group_size")
        if not isinstance(group, int) or group <= 0:
            raise refuse(f"{key}.weights.group_size", group, "strategy group needs a positive group size")
    return WeightScheme(bits=bits, group=group, symmetric=bool(w.get("symmetric", True)))


def parse(qc: dict) -> CompressedTensors:
    fmt = qc.get("format")
    if fmt not in (PACKED, "mixed-precision", None):
        raise refuse("format", fmt, f"compressed-tensors checkpoints are read in the {PACKED} format (integer "
                                    "weights only)")
    status = qc.get("quantization_status", "compressed")
    if status != "compressed":
        raise refuse("quantization_status", status, "only compressed (packed) checkpoints are read")
    for key in ("sparsity_config", "transform_config", "kv_cache_scheme"):
        if qc.get(key):
            raise refuse(key, "{...}", "sparsity, transforms and KV cache quantization are not supported")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise refuse("config_groups", groups, "no quantized weights are described")
    schemes = tuple(dict.fromkeys(_weights(name, grp, fmt if fmt != "mixed-precision" else None)
                                  for name, grp in groups.items()))
    return CompressedTensors(schemes=schemes)
