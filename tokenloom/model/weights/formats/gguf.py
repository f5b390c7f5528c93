"""GGUF checkpoints: llama.cpp's single file holding a model's config, tokenizer and tensors.

`tokenloom serve model.gguf`, `LLM("model.gguf")` and a directory that holds one .gguf and no
config.json all load through here:

* `gguf_path`: the GGUF file a model path names, if it names one;
* `read_config`: the file's metadata as the config.json dict the rest of tokenloom reads: the
  one transformers' GGUF reading builds (`transformers_config`), plus what its table leaves out:
  `architectures`, the dtype the file stores its float tensors in, the head size llama.cpp
  writes as `attention.key_length`, the file's own start / stop tokens, and llama.cpp's
  end-of-turn token as a second stop token;
* `load_tokenizer`: the tokenizer transformers builds from the file's vocabulary and merges;
* `open_file`: the file's header and tensors (gguf_file.py), every tensor checked against the
  types we read (gguf_blocks.py) before anything loads.

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
from gguf import GGMLQuantizationType

from tokenloom.model.weights.formats.gguf_blocks import check_type
from tokenloom.model.weights.formats.gguf_file import GGUFFile, read_gguf

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


def open_file(path: Path) -> GGUFFile:
    """The file's header and tensor views (nothing read yet: gguf_file.py), after refusing what we
    cannot load: another architecture, a split file, a tensor type we do not read, rotary factors."""
    f = read_gguf(path)
    arch = f.metadata.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path.name}: GGUF general.architecture {arch!r} is not supported; tokenloom reads "
                         f"{', '.join(ARCHITECTURES)}")
    if (f.metadata.get("split.count") or 1) > 1:
        raise ValueError(f"{path.name} is one part of a split GGUF (split.count {f.metadata['split.count']}); "
                         "merge the parts with llama-gguf-split --merge")
    for t in f.tensors:
        check_type(t)
        if t.name == "rope_freqs.weight" and not (np.asarray(t.data) == 1).all():
            # Llama 3.1+'s rotary scaling, which llama.cpp stores only as these factors; transformers'
            # GGUF reading drops it (a different model at every position), so we refuse rather than follow.
            raise ValueError(f"{path.name}: GGUF tensor 'rope_freqs.weight' (per-frequency rotary scaling, "
                             "as Llama 3.1+ files carry) is not supported yet; load the Hugging Face checkpoint")
    return f


def _stored_dtype(f: GGUFFile) -> str:
    """The float type most of the file's matrices are stored in (its `torch_dtype`, which
    `--dtype auto` follows): bfloat16 or float16 where that is it, else float32 -- quantized
    files too, whose dequantized matrices keep every bit in float32."""
    counts: dict[GGMLQuantizationType, int] = {}
    for t in f.tensors:
        if len(t.shape) == 2:
            counts[t.tensor_type] = counts.get(t.tensor_type, 0) + t.n_elements
    main = max(counts, key=counts.__getitem__) if counts else GGMLQuantizationType.F32
    return _DTYPE_NAMES.get(main, "float32")


def transformers_config(f: GGUFFile) -> dict:
    """The config dict transformers' GGUF reading builds for this file (`load_gguf_checkpoint`,
    which `AutoConfig.from_pretrained(dir, gguf_file=...)` runs for these families), from its
    own key table (`GGUF_CONFIG_MAPPING`) and rules: llama files named "mistral" are Mistral,
    the head is tied when there is no output matrix, the vocabulary size defaults to the token
    count; the config class then adds its defaults.  (Its reader walks the vocabulary element by
    element; gguf_file.py's does not, so this is built here.)"""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    md = f.metadata
    arch = md["general.architecture"]
    updated = "mistral" if "llama" in arch and md.get("general.name") == "mistral" else arch
    out: dict = {"tie_word_embeddings": f.tensor("output.weight") is None}
    for key, value in md.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target is not None and target != -1:
            out[target] = value[0] if isinstance(value, list) and len(value) == 1 else value
    if "vocab_size" not in out and "tokenizer.ggml.tokens" in md:
        out["vocab_size"] = md["tokenizer.ggml.tokens"]  # the token count (gguf_file.py keeps only that)
    return AutoConfig.for_model(**out).to_dict()


@functools.lru_cache(maxsize=4)
def _config(path: str, mtime_ns: int, size: int) -> dict:
    p = Path(path)
    f = open_file(p)
    md = f.metadata
    cfg = transformers_config(f)
    cfg["architectures"] = [_HF_CLASSES[cfg["model_type"]]]
    cfg["torch_dtype"] = _stored_dtype(f)
    key_length = md.get(f"{md['general.architecture']}.attention.key_length")
    if key_length:  # Qwen3's head size is not hidden / heads; transformers' table omits the key
        cfg["head_dim"] = int(key_length)
    # The stop and start tokens are the file's (transformers leaves its config class's defaults:
    # Llama's 1 and 2 whatever the vocabulary); llama.cpp also ends a turn on the end-of-turn token.
    for key in ("bos", "eos"):
        if f"tokenizer.ggml.{key}_token_id" in md:
            cfg[f"{key}_token_id"] = int(md[f"tokenizer.ggml.{key}_token_id"])
    eos, eot = cfg.get("eos_token_id"), md.get("tokenizer.ggml.eot_token_id")
    if eot is not None and eos is not None and int(eot) != eos:
        cfg["eos_token_id"] = [eos, int(eot)]
    return cfg


def read_config(path: Path) -> dict:
    """The config.json dict of GGUF file `path` (see the module doc); read once per file version."""
    st = path.stat()
    return copy.deepcopy(_config(str(path.resolve()), st.st_mtime_ns, st.st_size))


def load_tokenizer(path: Path):
    """The tokenizer transformers builds from the file (vocabulary, merges, special tokens, chat
    template), of the class `AutoTokenizer` picks for the family -- named here, because
    AutoTokenizer given a GGUF file first reads the whole file again for the config it picks the
    class from (the slow reader of gguf_file.py's doc).  Families with no tokenizer class of
    their own (llama) get transformers' generic one, as AutoTokenizer gives them; where these
    names do not exist (another transformers), plain AutoTokenizer."""
    import transformers
    from transformers import AutoTokenizer

    folder, kw = str(path.resolve().parent), dict(gguf_file=path.name)
    model_type = read_config(path)["model_type"]
    try:
        from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
    except ImportError:
        return AutoTokenizer.from_pretrained(folder, **kw)
    if TOKENIZER_MAPPING_NAMES.get(model_type) is not None:
        return AutoTokenizer.from_pretrained(folder, tokenizer_type=model_type, **kw)
    generic = getattr(transformers, "TokenizersBackend", None)
    return generic.from_pretrained(folder, **kw) if generic is not None else AutoTokenizer.from_pretrained(folder, **kw)
