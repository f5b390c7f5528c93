"""GGUF checkpoints: llama.cpp's single file holding a model's config, tokenizer and tensors.

`tokenloom serve model.gguf`, `LLM("model.gguf")` and a directory that holds one .gguf and no
config.json all load through here:

* `gguf_path`: the GGUF file a model path names, if it names one;
* `read_config`: the file's metadata as the config.json dict the rest of tokenloom reads.
  transformers reads it (`AutoConfig.from_pretrained(dir, gguf_file=...)`, the same reading its
  own GGUF loader uses), and we add what its table leaves out: `architectures`, the dtype the
  file stores its float tensors in, the head size llama.cpp writes as `attention.key_length`,
  and llama.cpp's end-of-turn token as a second stop token;
* `load_tokenizer`: the tokenizer transformers builds from the file's vocabulary and merges;
* `open_file`: the file's tensors, every one checked against the types we read
  (gguf_blocks.py) before anything loads.

The weights themselves: gguf_weights.py.  Families: llama (Mistral files too: llama.cpp writes
them as llama), qwen2, qwen3.  Split files (`-00001-of-00003.gguf`) are refused: merge them
with llama.cpp's `llama-gguf-split --merge` first; so are files whose rotary frequencies carry
per-frequency factors (`rope_freqs`, Llama 3.1+), which transformers' reading would drop.
"""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from tokenloom.model.weights.formats.gguf_blocks import check_type

SUFFIX = ".gguf"
# general.architecture -> what we run it as; transformers' model_type -> the HF class name
ARCHITECTURES = ("llama", "qwen2", "qwen3")
_HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
               "qwen3": "Qwen3ForCausalLM"}
_DTYPE_NAMES = {GGMLQuantizationType.BF16: "bfloat16", GGMLQuantizationType.F16: "float16"}


def gguf_path(path: Path) -> Path | None:
    """`path` if it is a .gguf file; the one .gguf in a directory without config.json; else None.
    FileNotFoundError for a directory with several .gguf files (naming them)."""
    if path.is_file():
        return path if path.suffix.lower() == SUFFIX else None
    if not path.is_dir() or (path / "config.json").exists():
        return None
    found = sorted(path.glob(f"*{SUFFIX}"))
    if len(found) > 1:
        raise FileNotFoundError(f"{path} holds {len(found)} GGUF files ({', '.join(f.name for f in found)}); "
                                "name the one to load")
    return found[0] if found else None


def _field(reader: GGUFReader, key: str):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def open_file(path: Path) -> tuple[GGUFReader, str]:
    """The file's reader (tensors memory-mapped, nothing read yet) and its architecture, after
    refusing what we cannot load: another architecture, a split file, a tensor type we do not read."""
    reader = GGUFReader(str(path))
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF general.architecture {arch!r} is not supported; tokenloom reads "
                         f"{', '.join(ARCHITECTURES)}")
    if (_field(reader, "split.count") or 1) > 1:
        raise ValueError(f"{path.name} is one part of a split GGUF (split.count "
                         f"{_field(reader, 'split.count')}); merge the parts with llama-gguf-split --merge")
    for t in reader.tensors:
        check_type(t)
        if t.name == "rope_freqs.weight" and not (np.asarray(t.data) == 1).all():
            # Llama 3.1+'s rotary scaling, which llama.cpp stores only as these factors; transformers'
            # GGUF reading drops it (a different model at every position), so we refuse rather than follow.
            raise ValueError(f"{path.name}: GGUF tensor 'rope_freqs.weight' (per-frequency rotary scaling, "
                             "as Llama 3.1+ files carry) is not supported yet; load the Hugging Face checkpoint")
    return reader, arch


def _stored_dtype(reader: GGUFReader) -> str:
    """The float type most of the file's matrices are stored in (its `torch_dtype`, which
    `--dtype auto` follows): bfloat16 or float16 where that is it, else float32 -- quantized
    files too, whose dequantized matrices keep every bit in float32."""
    counts: dict[GGMLQuantizationType, int] = {}
    for t in reader.tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type] = counts.get(t.tensor_type, 0) + int(t.n_elements)
    main = max(counts, key=counts.__getitem__) if counts else GGMLQuantizationType.F32
    return _DTYPE_NAMES.get(main, "float32")


@functools.lru_cache(maxsize=4)
def _config(path: str, mtime_ns: int, size: int) -> dict:
    from transformers import AutoConfig

    p = Path(path)
    reader, arch = open_file(p)
    cfg = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name).to_dict()
    cfg["architectures"] = [_HF_CLASSES[cfg["model_type"]]]
    cfg["torch_dtype"] = _stored_dtype(reader)
    key_length = _field(reader, f"{arch}.attention.key_length")
    if key_length:  # Qwen3's head size is not hidden / heads; transformers' table omits the key
        cfg["head_dim"] = int(key_length)
    eos, eot = cfg.get("eos_token_id"), _field(reader, "tokenizer.ggml.eot_token_id")
    if eot is not None and eos is not None and int(eot) != eos:  # llama.cpp ends a turn on either
        cfg["eos_token_id"] = [eos, int(eot)]
    return cfg


def read_config(path: Path) -> dict:
    """The config.json dict of GGUF file `path` (see the module doc); read once per file version."""
    st = path.stat()
    return copy.deepcopy(_config(str(path.resolve()), st.st_mtime_ns, st.st_size))


def load_tokenizer(path: Path):
    """The tokenizer transformers builds from the file (vocabulary, merges, special tokens, chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.resolve().parent), gguf_file=path.name)
