"""The fewest tokens a text can have, known from its length alone.

Refusing a prompt that does not fit `max_model_len` should not cost tokenizing all of it: a
10 MB prompt (under the body limit) takes seconds of CPU to tokenize, only to be told it is
too long.  For the tokenizers generative models use, every token stands for a bounded span
of the input text, so a text of B bytes has at least ceil(B / L) tokens, where L -- the most
input bytes one token can stand for -- is read once from the tokenizer:

* the longest vocabulary entry, in the bytes it covers: a byte-level BPE (GPT-2, Llama-3,
  Qwen) spells each byte as one printable character, so an entry covers as many bytes as it
  has characters; elsewhere (SentencePiece's "▁the", byte-fallback `<0xE4>`) the entry's
  UTF-8 length bounds the bytes it covers (▁ is 3 bytes for a 1-byte space: a looser bound,
  never a wrong one);
* added tokens (`<|im_start|>`, ...): the length of their text;
* times how far the normalizer may shrink text on the way in: Prepend and a Replace that
  does not shorten (Llama-2's " " -> "▁") not at all; Unicode normalization forms and
  lowercasing at most 4x (one 4-byte character becomes at least one byte, and compositions
  at most 3x: the Hangul L+V+T jamo).

Where text can vanish without bound the tokenizer gets no bound (`None`) and prompts are
tokenized in full, as before: a normalizer that strips or drops characters (BERT's, Strip,
StripAccents, SentencePiece's precompiled charsmap, a regex Replace), a pre-tokenizer that
removes what it splits on (Whitespace, BertPreTokenizer), an added token that swallows the
spaces beside it (lstrip/rstrip), or a model that can fuse any run of unknown characters
into one `<unk>` (no complete byte alphabet or byte fallback).  `bound_for` says which.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger("tokenloom.engine")

# How much a normalizer may shrink text, in bytes (None: without bound).
_UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
_SHRINK_FREE = {"Prepend", "ByteLevel"}  # ByteLevel respells each byte as 1-2
# Pre-tokenizers that only split (or respell) text, never drop any of it.
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}


def _byte_level_alphabet() -> frozenset[str]:
    """The 256 printable characters a byte-level BPE spells bytes with (GPT-2's table)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in printable]
    return frozenset([chr(b) for b in printable] + [chr(256 + i) for i in range(len(moved))])


_BYTE_CHARS = _byte_level_alphabet()


@dataclass(frozen=True)
class PromptBound:
    """`max_bytes_per_token` (L) of one tokenizer, or None with the reason there is none."""

    max_bytes_per_token: int | None
    why_none: str = ""

    def min_tokens(self, text: str) -> int:
        """A lower bound on the tokens of `text` (0 without a bound).  O(len) and allocation-
        free for ASCII text; otherwise one UTF-8 encode, still far cheaper than tokenizing."""
        if self.max_bytes_per_token is None or not text:
            return 0
        nbytes = len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass"))
        return math.ceil(nbytes / self.max_bytes_per_token)


def _kinds(spec: Any) -> list[dict]:
    """A normalizer/pre-tokenizer spec flattened (Sequence members in order)."""
    if spec is None:
        return []
    if spec.get("type") == "Sequence":
        key = "normalizers" if "normalizers" in spec else "pretokenizers"
        return [k for member in spec.get(key, []) for k in _kinds(member)]
    return [spec]


def _shrink(normalizer: Any) -> tuple[int | None, str]:
    """The most the normalizer can shrink text (input bytes per normalized byte)."""
    factor = 1
    for n in _kinds(normalizer):
        kind = n.get("type")
        if kind in _SHRINK_FREE:
            continue
        if kind in _UNICODE_FORMS:
            factor *= 4
        elif kind == "Replace" and "String" in (n.get("pattern") or {}):
            src, dst = n["pattern"]["String"].encode(), str(n.get("content", "")).encode()
            if not dst:
                return None, f"the normalizer deletes {src!r}"
            factor *= max(1, math.ceil(len(src) / len(dst)))
        else:
            return None, f"the {kind} normalizer may drop text"
    return factor, ""


def _keeps_text(pre_tokenizer: Any) -> tuple[bool, str]:
    for p in _kinds(pre_tokenizer):
        kind = p.get("type")
        if kind not in _KEEPING_PRE_TOKENIZERS:
            return False, f"the {kind} pre-tokenizer may drop text"
        if str(p.get("behavior", "")).lower() == "removed":
            return False, f"the {kind} pre-tokenizer removes what it splits on"
    return True, ""


def _entry_bytes(entry: str, byte_level: bool) -> int:
    if byte_level:
        return sum(1 if c in _BYTE_CHARS else len(c.encode("utf-8")) for c in entry)
    return len(entry.encode("utf-8"))


def bound_for(tokenizer: Any) -> PromptBound:
    """L for a Hugging Face fast tokenizer (its tokenizer.json), or None and why."""
    backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        return PromptBound(None, "not a fast (Rust) tokenizer: its pipeline cannot be read")
    try:
        spec = json.loads(backend.to_str())
    except Exception as e:  # an exotic backend
        return PromptBound(None, f"the tokenizer's spec cannot be read ({type(e).__name__})")
    factor, why = _shrink(spec.get("normalizer"))
    if factor is None:
        return PromptBound(None, why)
    keeps, why = _keeps_text(spec.get("pre_tokenizer"))
    if not keeps:
        return PromptBound(None, why)
    model = spec.get("model") or {}
    kind = model.get("type")
    vocab = model.get("vocab")
    if kind == "BPE" and isinstance(vocab, dict):
        entries = list(vocab)
    elif kind == "Unigram" and isinstance(vocab, list):
        entries = [e[0] for e in vocab]
    else:
        return PromptBound(None, f"a {kind} model maps a whole word (of any length) to one unknown token")
    byte_level = any(p.get("type") == "ByteLevel"
                     for p in _kinds(spec.get("pre_tokenizer")) + _kinds(spec.get("normalizer")))
    present = set(entries)
    complete = (byte_level and _BYTE_CHARS <= present) or (
        bool(model.get("byte_fallback")) and all(f"<0x{b:02X}>" in present for b in range(256)))
    unk = model.get("unk_token") if kind == "BPE" else model.get("unk_id")
    if not complete and unk is not None and model.get("fuse_unk", kind == "Unigram"):
        return PromptBound(None, "a run of unknown characters fuses into one unknown token")
    # A character the vocabulary lacks is its own unknown token (at most 4 bytes), or dropped
    # when there is no unknown token at all: no bound then.
    if not complete and unk is None:
        return PromptBound(None, "characters outside the vocabulary are dropped (no unknown token, no byte fallback)")
    longest = max((_entry_bytes(e, byte_level) for e in entries), default=1)
    longest = max(longest, 4) * factor
    for added in spec.get("added_tokens") or []:
        if added.get("lstrip") or added.get("rstrip"):
            return PromptBound(None, f"the added token {added.get('content')!r} swallows the whitespace beside it")
        size = len(str(added.get("content", "")).encode("utf-8"))
        longest = max(longest, size * (factor if added.get("normalized") else 1))
    return PromptBound(longest)


def prompt_bound(tokenizer: Any) -> PromptBound:
    """`bound_for`, computed once per tokenizer object (cached on it), logged once."""
    cached = getattr(tokenizer, "_tokenloom_prompt_bound", None)
    if isinstance(cached, PromptBound):
        return cached
    bound = bound_for(tokenizer)
    if bound.max_bytes_per_token is None:
        logger.warning("prompts are tokenized in full before their length is checked: %s", bound.why_none)
    try:
        tokenizer._tokenloom_prompt_bound = bound
    except AttributeError:  # a tokenizer that takes no attributes: recomputed next time
        pass
    return bound
