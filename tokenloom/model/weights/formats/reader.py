"""The loader's hook for a pre-quantized checkpoint (model/weights/loader.py `load_model`).

Three calls, in the loader's order:

1. built before the model's memory is allocated (`open_reader`): lists the checkpoint's
   quantized linear layers and leaves their dense weights unallocated (an 8B model's float32
   weights are never materialized just to be replaced);
2. `take`, for each tensor the loader meets: a quantized layer's tensors are kept here, every
   other tensor (embeddings, norms, biases, layers the checkpoint left dense) loads as usual;
3. `install`, once every tensor is read: each of our linears whose checkpoint weights were
   quantized (q, k, v together for the fused projection) is mapped by to_kernels.py onto our
   kernels or dequantized into a dense weight, and counted as filled.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from tokenloom.model.weights.formats.checkpoint_format import CheckpointFormat
from tokenloom.model.weights.formats.to_kernels import Prequantized, map_weight
from tokenloom.model.weights.quantization import PanelQuantized, QuantLinear

log = logging.getLogger("tokenloom.model.weights")

Target = Callable[[str], "tuple[str, int | None] | None"]  # checkpoint name -> (our parameter, part)


class PrequantizedReader:
    """Collects and installs one checkpoint's quantized linear layers (see the module doc)."""

    def __init__(self, fmt: CheckpointFormat, files: list[Path], target: Target, model: nn.Module):
        self.fmt = fmt
        names: set[str] = set()
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                names.update(sf.keys())
        quantized = sorted(n.rpartition(".")[0] for n in names if n.rpartition(".")[2] == fmt.primary)
        self.quantized = set(quantized)
        self.tensors: dict[str, dict[str, torch.Tensor]] = {p: {} for p in quantized}
        # our parameter -> the checkpoint layers (and which part of it each is) that fill it
        self.targets: dict[str, list[tuple[int, str]]] = {}
        for prefix in quantized:
            tgt = target(prefix + ".weight")
            if tgt is not None:
                self.targets.setdefault(tgt[0], []).append((tgt[1] or 0, prefix))
        for n in names:  # a fused projection whose parts come half quantized, half dense
            tgt = target(n) if n.endswith(".weight") else None
            if tgt is not None and tgt[0] in self.targets and n.removesuffix(".weight") not in self.quantized:
                raise ValueError(f"{fmt.method} checkpoint: {n} is dense but the layers fused with it into "
                                 f"{tgt[0]} are quantized")
        for pname in self.targets:
            linear = _linear(model, pname)
            # not allocated with the model: installed (or dequantized) whole by `install`
            linear.weight = nn.Parameter(torch.empty(0, device=linear.weight.device, dtype=linear.weight.dtype),
                                         requires_grad=False)

    def take(self, file: Path, name: str) -> bool:
        """Keep `name` if it is a quantized layer's tensor (True); else the loader reads it."""
        prefix, _, suffix = name.rpartition(".")
        if prefix not in self.quantized or suffix not in self.fmt.tensors:
            return False
        with safe_open(str(file), framework="pt", device="cpu") as sf:
            self.tensors[prefix][suffix] = sf.get_tensor(name).clone()  # small: packed integers and scales
        return True

    def install(self, model: nn.Module, filled: dict[str, int], *, panels: bool, dtype: torch.dtype,
                device: torch.device) -> dict[str, str]:
        """Put every quantized layer in place (see the module doc); returns how each of our
        linears runs, in words, by module name."""
        how: dict[str, str] = {}
        for pname, parts in sorted(self.targets.items()):
            parts.sort()
            weights = [self.fmt.read(self.tensors.pop(prefix), prefix) for _, prefix in parts]
            linear = _linear(model, pname)
            n, k = sum(w.shape[0] for w in weights), weights[0].shape[1]
            if (n, k) != (linear.out_features, linear.in_features):
                raise ValueError(f"{self.fmt.method} checkpoint: {', '.join(p for _, p in parts)} hold a [{n}, {k}] "
                                 f"weight; {pname} is [{linear.out_features}, {linear.in_features}]")
            mapped = map_weight(weights, panels=panels, dtype=dtype)
            path = pname.removesuffix(".weight")
            if mapped.matrix is not None:
                matrix = mapped.matrix if panels else mapped.matrix.to(device)
                core = matrix.inner if isinstance(matrix, Prequantized) else matrix
                pad = core.qweight.shape[0] * 32 if isinstance(core, PanelQuantized) else None
                parent, _, attr = path.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, QuantLinear(matrix, linear.bias, pad))
            else:
                linear.weight = nn.Parameter(mapped.dense.to(device), requires_grad=False)
            filled[pname] = filled.get(pname, 0) + len(parts)
            how[path] = mapped.why
        self.tensors.clear()
        for why, count in Counter(how.values()).items():
            log.info("%s: %d linear layers: %s", self.fmt.method, count, why)
        return how


def _linear(model: nn.Module, pname: str) -> nn.Linear:
    path = pname.removesuffix(".weight")
    mod = model.get_submodule(path) if pname.endswith(".weight") else None
    if not isinstance(mod, nn.Linear):
        raise ValueError(f"quantized checkpoint weights for {pname}: not a linear layer of ours, so they cannot be read")
    return mod
