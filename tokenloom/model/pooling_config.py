"""How an embedding model turns its hidden states into one vector: read from its files.

A sentence-transformers model directory says it in `modules.json`: a Transformer module
(the network, at the directory's root), a Pooling module (`1_Pooling/config.json`: which
position(s) to pool) and optionally a Normalize module (unit length).  Both spellings of
the pooling config are read -- the older flags (`pooling_mode_lasttoken: true`, ...) and
sentence-transformers 5's `pooling_mode: "lasttoken"`.  Supported: last token, mean and
CLS (first token) pooling, each with or without Normalize.  Anything else a model
declares (a Dense projection, max or weighted-mean pooling, prompts excluded from the
pool) is refused with a ValueError naming it, never silently pooled another way.

A decoder without these files pools its last token and normalises (how decoder embedding
models such as e5-mistral are used); `PoolingConfig.source` says which applied.

Matryoshka models (whose leading components are a usable embedding on their own) declare
it in config.json -- `matryoshka_dimensions: [...]` or `is_matryoshka: true` -- and only
they take a request's `dimensions`.  Pure Python: no torch here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

PoolingMode = Literal["last", "mean", "cls"]

# sentence-transformers' names -> ours
_MODES: dict[str, PoolingMode] = {"lasttoken": "last", "mean": "mean", "cls": "cls"}
_OLD_FLAGS = {"pooling_mode_lasttoken": "lasttoken", "pooling_mode_mean_tokens": "mean",
              "pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
              "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
              "pooling_mode_weightedmean_tokens": "weightedmean"}


@dataclass(frozen=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool
    dimensions: int  # the full embedding's length (the hidden size)
    matryoshka_dimensions: tuple[int, ...] | None = None  # the lengths the model was trained for
    is_matryoshka: bool = False  # a request may shorten the vector (`dimensions`)
    source: str = "default"  # where the settings came from (the start-up summary says it)

    def describe(self) -> str:
        norm = ", normalised" if self.normalize else ""
        return f"{self.mode}-token pooling{norm} ({self.source})" if self.mode != "mean" else \
            f"mean pooling{norm} ({self.source})"

    def check_dimensions(self, dimensions: int | None) -> None:
        """ValueError (naming `dimensions`) unless the model can honour a request's length."""
        if dimensions is None:
            return
        if not self.is_matryoshka:
            raise ValueError("dimensions: this model does not support matryoshka representation (its config "
                             "declares neither matryoshka_dimensions nor is_matryoshka); shortening its "
                             "embeddings would make them meaningless")
        if self.matryoshka_dimensions is not None and dimensions not in self.matryoshka_dimensions:
            raise ValueError(f"dimensions: this model supports {list(self.matryoshka_dimensions)}, got {dimensions}")
        if not 1 <= dimensions <= self.dimensions:
            raise ValueError(f"dimensions: must be between 1 and {self.dimensions}, got {dimensions}")


def _read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


def _pooling_mode(cfg: dict, where: Path) -> PoolingMode:
    if "pooling_mode" in cfg:  # sentence-transformers >= 5
        names = [cfg["pooling_mode"]] if isinstance(cfg["pooling_mode"], str) else list(cfg["pooling_mode"])
    else:
        names = [name for flag, name in _OLD_FLAGS.items() if cfg.get(flag)]
    if len(names) != 1:
        raise ValueError(f"{where}: pooling_mode must name exactly one mode, got {names or 'none'}")
    mode = _MODES.get(names[0])
    if mode is None:
        raise ValueError(f"{where}: pooling_mode {names[0]!r} is not supported (lasttoken, mean, cls)")
    if cfg.get("include_prompt", True) is not True:
        raise ValueError(f"{where}: include_prompt false (an instruction left out of the pool) is not supported")
    return mode


def read_pooling_config(path: Path, hf_config: dict, hidden_size: int) -> PoolingConfig:
    """The pooling a model at `path` asks for (see the module docstring)."""
    matryoshka = hf_config.get("matryoshka_dimensions")
    extra = dict(dimensions=hidden_size,
                 matryoshka_dimensions=tuple(int(d) for d in matryoshka) if matryoshka else None,
                 is_matryoshka=bool(matryoshka) or bool(hf_config.get("is_matryoshka", False)))
    modules_file = path / "modules.json"
    if not modules_file.exists():
        return PoolingConfig(mode="last", normalize=True, source="default: no modules.json", **extra)
    mode: PoolingMode | None = None
    normalize = False
    for m in _read_json(modules_file):
        kind = str(m.get("type", "")).rpartition(".")[2]
        if kind == "Transformer":
            if m.get("path", "") not in ("", "."):
                raise ValueError(f"{modules_file}: the Transformer module must be the directory itself, "
                                 f"got path {m.get('path')!r}")
        elif kind == "Pooling":
            if mode is not None:
                raise ValueError(f"{modules_file}: more than one Pooling module")
            cfg_file = path / m.get("path", "") / "config.json"
            mode = _pooling_mode(_read_json(cfg_file), cfg_file)
        elif kind == "Normalize":
            normalize = True
        else:
            raise ValueError(f"{modules_file}: sentence-transformers module {m.get('type')!r} is not supported "
                             f"(Transformer, Pooling, Normalize)")
    if mode is None:
        raise ValueError(f"{modules_file}: no Pooling module")
    return PoolingConfig(mode=mode, normalize=normalize, source="sentence-transformers modules.json", **extra)
