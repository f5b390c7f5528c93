"""Checkpoints that arrive already quantized, read as the library that wrote them lays them out.

One module per format (GGUF; GPTQ / AWQ; compressed-tensors): each turns the file's tensors into
the weights our linears run -- kept in our int8 / int4 kernels' layouts where the bits map onto
them, dequantized at load where they do not -- and refuses, naming the setting, what it cannot read.

For the Hugging Face directory formats, config.json's `quantization_config.quant_method` picks
the reader (`checkpoint_format`): gptq.py, awq.py, compressed_tensors.py.  Their shared pieces:
int_weight.py (the matrix in the formats' common terms), to_kernels.py (onto our kernels),
reader.py (the loader's hook).  docs/models.md, "GPTQ, AWQ and compressed-tensors", has the table.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from tokenloom.model.weights.formats import awq, compressed_tensors, gptq
from tokenloom.model.weights.formats.checkpoint_format import CheckpointFormat, refuse
from tokenloom.model.weights.formats.reader import PrequantizedReader

PARSERS: dict[str, Callable[[dict], CheckpointFormat]] = {
    "gptq": gptq.parse,
    "awq": awq.parse,
    "compressed-tensors": compressed_tensors.parse,
}


def checkpoint_format(cfg: dict) -> CheckpointFormat | None:
    """The pre-quantized format config.json declares, its settings checked; None for a plain
    checkpoint.  ValueError naming the setting for anything we cannot run."""
    qc = cfg.get("quantization_config") or cfg.get("compression_config")  # the latter: older compressed-tensors
    if not qc:
        return None
    if not isinstance(qc, dict):
        raise ValueError(f"config.json's quantization_config must be an object, got {type(qc).__name__}")
    method = qc.get("quant_method")
    if method not in PARSERS:
        raise refuse("quant_method", method, f"pre-quantized checkpoints are read from {', '.join(PARSERS)} "
                                             "(integer weights, 4 or 8 bits)")
    return PARSERS[method](qc)


def describe_prequantized(cfg: dict) -> str | None:
    """The checkpoint's quantization in words (the backend plan's `prequantized`), or None."""
    fmt = checkpoint_format(cfg)
    return None if fmt is None else fmt.describe()


def open_reader(cfg: dict, planned: str | None, files: list[Path],
                target: Callable[[str], tuple[str, int | None] | None], model: nn.Module) -> PrequantizedReader | None:
    """The loader's hook (reader.py) for the checkpoint `cfg` describes, or None for a plain
    one; `planned` is what the backend plan was made for (they must agree)."""
    fmt = checkpoint_format(cfg)
    found = None if fmt is None else fmt.describe()
    if found != planned:
        raise ValueError(f"the backend plan was made for {'a plain checkpoint' if planned is None else planned!r}, "
                         f"but the checkpoint is {'plain' if found is None else found!r}")
    return None if fmt is None else PrequantizedReader(fmt, files, target, model)
