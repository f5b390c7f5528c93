"""Build byte-level BPE tokenizers from the running interpreter's standard library.

tokenloom ships its own small model and makes random-weight models with `make-model`; both need
a tokenizer that exists without a network.  The one corpus every Python installation carries is
its own standard library, so we train on that:

* `stdlib_corpus_files` lists the stdlib `.py` files, deterministically, and splits off a fixed
  held-out validation set by a stable hash of each file's relative path (so the split does not
  depend on the machine, the install prefix, or which other files exist).
* `build_bytelevel_bpe` trains a byte-level BPE: every byte is in the base alphabet, so *any*
  text (Chinese included) round-trips exactly; merges are learned on top.
* `save_hf_tokenizer` writes the files `transformers.AutoTokenizer` expects, with a ChatML
  chat template or a family's own (`CHAT_FORMATS`: Gemma's turns, Phi-3's role tags), whose
  markers `add_chat_tokens` appends to the vocabulary as special tokens.
* `default_tokenizer` trains a small one in a few seconds and caches it on disk.

Special tokens have fixed ids regardless of vocabulary size, which lets presets hard-code
`bos_token_id=1`, `eos_token_id=2`:

    0 <|pad|>   1 <|bos|>   2 <|endoftext|> (eos)   3 <|im_start|>   4 <|im_end|>
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import sysconfig
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD_TOKEN = "<|pad|>"
BOS_TOKEN = "<|bos|>"
EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
# Order == id: the BPE trainer assigns special tokens the first ids in list order.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN)
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)



@dataclass(frozen=True)
class ChatFormat:
    """A family's chat template, the special tokens it writes (appended to the vocabulary
    after the trained entries) and the one that ends a turn (a stop token beside EOS)."""

    template: str
    special_tokens: tuple[str, ...] = ()
    end_of_turn: str | None = None


# Gemma's turns: <start_of_turn>user|model ... <end_of_turn>, a system message folded into
# the first user turn (Gemma has no system role), BOS first.
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set ns = namespace(prefix='') %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{% set ns.prefix = message['content'] | trim + '\n\n' %}"
    "{% else %}"
    "{{ '<start_of_turn>' + ('model' if message['role'] == 'assistant' else message['role']) + '\n' "
    "+ ns.prefix + message['content'] | trim + '<end_of_turn>\n' }}{% set ns.prefix = '' %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)
# Phi-3's role tags: <|system|> / <|user|> / <|assistant|>, each message closed by <|end|>.
PHI3_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + '<|end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)
CHAT_FORMATS: dict[str, ChatFormat] = {
    "chatml": ChatFormat(DEFAULT_CHAT_TEMPLATE),
    "gemma": ChatFormat(GEMMA_CHAT_TEMPLATE, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>"),
    "phi3": ChatFormat(PHI3_CHAT_TEMPLATE, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>"),
}


def add_chat_tokens(tok: Tokenizer, fmt: ChatFormat) -> Tokenizer:
    """`tok` with `fmt`'s markers appended as special tokens (ids from its vocabulary size on)."""
    missing = [t for t in fmt.special_tokens if tok.token_to_id(t) is None]
    if missing:
        tok.add_special_tokens(missing)
    return tok


# Directories that are not ordinary Python source: third-party packages, py2-syntax fixtures,
# and demo scripts.  The CPython test suite itself is kept: it is real code and doubles the data.
_EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "lib2to3", "turtledemo", "__pycache__"})
# Generated or fixture files larger than this are mostly data tables, not code.
_MAX_FILE_BYTES = 512 * 1024
# ~3% of files are held out: bucket = sha256(relative path) mod 1000 < 30.
_VAL_PER_MILLE = 30
# Bump when the training recipe of `default_tokenizer` changes, so stale caches are ignored.
_DEFAULT_TOKENIZER_VERSION = 1
_DEFAULT_TOKENIZER_MAX_BYTES = 3_000_000


def stdlib_root() -> Path:
    """The running interpreter's standard library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_val_file(rel_path: str) -> bool:
    """Stable held-out assignment from a POSIX relative path (independent of machine and order)."""
    digest = hashlib.sha256(rel_path.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") % 1000 < _VAL_PER_MILLE


def _is_utf8_text(path: Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False  # some test fixtures deliberately use other encodings
    return True


def stdlib_corpus_files(split: Literal["train", "val"]) -> list[Path]:
    """Sorted standard-library `.py` files of one split ("train" or "val")."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    root = stdlib_root()
    want_val = split == "val"
    out: list[Path] = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if _EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size > _MAX_FILE_BYTES or is_val_file(rel.as_posix()) != want_val:
            continue
        if _is_utf8_text(path):
            out.append(path)
    # Sort by relative path so the order is the same whatever the install prefix.
    out.sort(key=lambda p: p.relative_to(root).as_posix())
    return out


def iter_texts(files: list[Path], max_bytes: int | None = None) -> Iterator[str]:
    """File contents in order, stopping once `max_bytes` UTF-8 bytes have been yielded.

    A file that would cross the cap is truncated at a character boundary, so the corpus size
    (and hence the trained tokenizer) is exactly determined by (files, max_bytes).
    """
    used = 0
    for path in files:
        text = path.read_text(encoding="utf-8")
        if max_bytes is not None:
            data = text.encode("utf-8")
            if used + len(data) > max_bytes:
                remaining = max_bytes - used
                if remaining > 0:
                    yield data[:remaining].decode("utf-8", errors="ignore")
                return
            used += len(data)
        yield text


def build_bytelevel_bpe(vocab_size: int, files: list[Path], max_bytes: int | None = None) -> Tokenizer:
    """Train a byte-level BPE of exactly `vocab_size` entries (if the corpus has enough merges).

    No BOS is added automatically: the engine and the training script decide when to add one.
    """
    min_size = len(SPECIAL_TOKENS) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be >= {min_size} (256 bytes + {len(SPECIAL_TOKENS)} specials)")
    tok = Tokenizer(models.BPE())
    # add_prefix_space=False: a leading space would change the text and break exact round-trips.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(files, max_bytes), trainer=trainer)
    for i, name in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(name) != i:  # guard against a library change in id assignment
            raise RuntimeError(f"special token {name} got id {tok.token_to_id(name)}, expected {i}")
    return tok


def save_hf_tokenizer(
    tok: Tokenizer,
    out_dir: str | os.PathLike[str],
    *,
    model_max_length: int,
    chat_template: str = DEFAULT_CHAT_TEMPLATE,
) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for transformers."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    specials = {i: t.content for i, t in sorted(tok.get_added_tokens_decoder().items()) if t.special}
    added = {
        str(i): {
            "content": name,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, name in specials.items()
    }
    # every special token beyond pad/bos/eos: ChatML's markers and a family's
    extra = [name for name in specials.values() if name not in (PAD_TOKEN, BOS_TOKEN, EOS_TOKEN)]
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": extra,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": chat_template,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    special_map = {
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": extra,
    }
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def tokenizer_cache_dir() -> Path:
    """`$TOKENLOOM_CACHE/tokenizers` if set, else `~/.cache/tokenloom/tokenizers`."""
    base = os.environ.get("TOKENLOOM_CACHE")
    root = Path(base) if base else Path.home() / ".cache" / "tokenloom"
    return root / "tokenizers"


def default_tokenizer(vocab_size: int) -> Tokenizer:
    """A quickly trained (a few seconds), disk-cached tokenizer for random-weight models.

    Keyed by vocab size and Python version, because the stdlib (the corpus) differs between
    Python versions; within one key the result is deterministic.
    """
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    path = tokenizer_cache_dir() / f"stdlib-bpe-v{_DEFAULT_TOKENIZER_VERSION}-py{py}-vocab{vocab_size}.json"
    if path.is_file():
        try:
            return Tokenizer.from_file(str(path))
        except Exception:  # a corrupt cache entry is rebuilt rather than fatal
            pass
    tok = build_bytelevel_bpe(vocab_size, stdlib_corpus_files("train"), max_bytes=_DEFAULT_TOKENIZER_MAX_BYTES)
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write-then-rename: concurrent callers (parallel tests) never see a half-written file.
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return tok
