"""What every pre-quantized checkpoint format tells the loader: which tensors make up one
quantized linear layer, how to read them into an `IntWeight`, and its settings in words.

Settings are read from config.json's `quantization_config` when the backend plan is made, so
anything we cannot run is refused before a weight is read, with a ValueError naming the key
(`quantization_config.<key> = value`).
"""

from __future__ import annotations

from typing import Any

import torch

from tokenloom.model.weights.formats.int_weight import IntWeight


class CheckpointFormat:
    """One format's reader, built from its `quantization_config` (each format's `parse`)."""

    method: str = ""  # quantization_config.quant_method
    primary: str = ""  # the tensor that marks a linear layer as quantized: <module>.<primary>
    tensors: frozenset[str] = frozenset()  # every tensor name (after the module's) the format stores
    required: frozenset[str] = frozenset()

    def describe(self) -> str:
        """The settings in words (the start-up summary; the backend plan's `prequantized`)."""
        raise NotImplementedError

    def read(self, tensors: dict[str, torch.Tensor], module: str) -> IntWeight:
        """One linear layer's tensors (keyed by the names in `tensors`) as an IntWeight."""
        raise NotImplementedError

    def check_complete(self, tensors: dict[str, torch.Tensor], module: str) -> None:
        missing = sorted(self.required - set(tensors))
        if missing:
            raise ValueError(f"{self.method} checkpoint: {module} has {self.primary} but no "
                             f"{', '.join(module + '.' + m for m in missing)}")


def refuse(key: str, value: Any, why: str) -> ValueError:
    """The load-time error for a setting we cannot run, naming it as config.json spells it."""
    return ValueError(f"quantization_config.{key} = {value!r}: {why}")


def int_setting(qc: dict, key: str, default: Any, *aliases: str) -> int:
    """An integer setting, under its name or an older spelling."""
    for k in (key, *aliases):
        if k in qc and qc[k] is not None:
            v = qc[k]
            if isinstance(v, bool) or not isinstance(v, int):
                raise refuse(k, v, "must be an integer")
            return v
    return default


def group_setting(qc: dict, key: str, default: int, *aliases: str) -> int:
    """A group size: a positive number of inputs, or -1 (one group per output row)."""
    g = int_setting(qc, key, default, *aliases)
    if g != -1 and g <= 0:
        raise refuse(key, g, "a group size is a positive number of inputs, or -1 for one group per row")
    return g


def group_words(group: int) -> str:
    return "per row" if group == -1 else f"group {group}"
