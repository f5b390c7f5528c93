"""Readable token strings — the seed's `[token1, token2, ... token7]`, made concrete.

The seed draws 「北京是中国的首都，上海是」 as 7 tokens.  A real byte-level BPE
vocabulary may cut one Chinese character (3 UTF-8 bytes) across several tokens, so a
single token is often *part* of a character and `tokenizer.decode([id])` prints only
U+FFFD.  To show something honest we recover each token's raw bytes:

  * byte-level BPE (GPT-2 / Qwen / Llama-3): every byte is spelled as one printable
    unicode character; we invert that spelling;
  * SentencePiece with byte fallback (Llama-2 / Mistral): `<0xE4>` pieces are bytes,
    `▁` is a space;
  * anything else: whatever `decode([id])` gives.

A token whose bytes are not a whole UTF-8 character is labelled with its bytes in hex,
`<e4 b8>`, and text is accumulated across tokens until characters complete.

The result is a plain `{id: TokenPiece}` table that travels with the trace (JSON), so
every renderer works without the tokenizer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Iterable


@dataclass(frozen=True)
class TokenPiece:
    """What one token id stands for."""

    text: str  # tokenizer.decode([id]) (may be U+FFFD for a partial character)
    raw: bytes | None  # the token's bytes when the vocabulary is byte-based, else None
    special: bool = False  # <|endoftext|> and friends: shown by name, not as text

    def to_dict(self) -> dict:
        return {"text": self.text, "bytes": self.raw.hex() if self.raw is not None else None, "special": self.special}

    @classmethod
    def from_dict(cls, d: dict) -> "TokenPiece":
        raw = d.get("bytes")
        return cls(d["text"], bytes.fromhex(raw) if raw is not None else None, bool(d.get("special")))


# ---- byte-level BPE: the 256 bytes spelled as printable characters ----------------
def _byte_spelling() -> dict[str, int]:
    """Inverse of the byte -> printable-character table byte-level BPE vocabularies use:
    bytes that are already printable Latin-1 stand for themselves, the others are moved,
    in order, to code points 256, 257, ... so no token contains a control character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    spelled: dict[str, int] = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            spelled[chr(256 + extra)] = b
            extra += 1
    return spelled


_BYTE_OF_CHAR = _byte_spelling()


def _decoder_kinds(tokenizer: Any) -> set[str]:
    """Decoder types named in a fast tokenizer's tokenizer.json (recursing into Sequence)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return set()
    try:
        spec = json.loads(backend.to_str()).get("decoder")
    except Exception:  # an exotic backend: fall back to decode([id])
        return set()
    kinds: set[str] = set()
    stack = [spec]
    while stack:
        d = stack.pop()
        if isinstance(d, dict):
            if "type" in d:
                kinds.add(str(d["type"]))
            stack.extend(d.get("decoders") or [])
    return kinds


def build_token_table(tokenizer: Any, ids: Iterable[int]) -> dict[int, TokenPiece]:
    """TokenPiece for each id, for any tokenizer transformers loads."""
    kinds = _decoder_kinds(tokenizer)
    special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for tid, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special_ids.add(int(tid))
    table: dict[int, TokenPiece] = {}
    for tid in sorted(set(int(i) for i in ids)):
        text = tokenizer.decode([tid], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if tid in special_ids:
            table[tid] = TokenPiece(text, None, special=True)
            continue
        piece = tokenizer.convert_ids_to_tokens(tid)
        raw: bytes | None = None
        if isinstance(piece, str):
            if "ByteLevel" in kinds and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
            elif "ByteFallback" in kinds and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
                raw = bytes([int(piece[3:5], 16)])
            elif kinds & {"Metaspace", "Replace", "ByteFallback"}:
                raw = piece.replace("▁", " ").encode("utf-8")
        if raw is None and "\ufffd" not in text:
            raw = text.encode("utf-8")  # decode() is exact when it yields whole characters
        table[tid] = TokenPiece(text, raw, special=False)
    return table


# ---- turning bytes into readable labels -------------------------------------------
def _utf8_len(lead: int) -> int:
    """Length of the UTF-8 sequence a lead byte starts (0: not a lead byte)."""
    if lead < 0x80:
        return 1
    if 0xC2 <= lead <= 0xDF:
        return 2
    if 0xE0 <= lead <= 0xEF:
        return 3
    if 0xF0 <= lead <= 0xF4:
        return 4
    return 0


def split_utf8(raw: bytes) -> list[str | bytes]:
    """Split bytes into runs of complete characters (str) and stray bytes (bytes)."""
    runs: list[str | bytes] = []
    i = 0
    while i < len(raw):
        n = _utf8_len(raw[i])
        ch = None
        if n and i + n <= len(raw):
            try:
                ch = raw[i : i + n].decode("utf-8")
            except UnicodeDecodeError:
                ch = None
        if ch is not None:
            if runs and isinstance(runs[-1], str):
                runs[-1] += ch
            else:
                runs.append(ch)
            i += n
        else:
            if runs and isinstance(runs[-1], bytes):
                runs[-1] += raw[i : i + 1]
            else:
                runs.append(raw[i : i + 1])
            i += 1
    return runs


_ESCAPES = {"\n": "\\n", "\t": "\\t", "\r": "\\r"}


def visible(s: str) -> str:
    """Make whitespace and control characters visible in one line of text."""
    out = []
    for c in s:
        if c in _ESCAPES:
            out.append(_ESCAPES[c])
        elif ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0:
            out.append(f"\\x{ord(c):02x}")
        else:
            out.append(c)
    return "".join(out)


def hex_bytes(raw: bytes) -> str:
    return "<" + " ".join(f"{b:02x}" for b in raw) + ">"


def label(piece: TokenPiece | None) -> str:
    """One token, readable: `"北"`, `" the"`, `<e4 b8>`, `"a"<e4>`, `<|endoftext|>`."""
    if piece is None:
        return "?"
    if piece.special:
        return piece.text
    if piece.raw is None:
        return f'"{_quoted(piece.text)}"'
    if not piece.raw:
        return '""'
    return "".join(f'"{_quoted(r)}"' if isinstance(r, str) else hex_bytes(r) for r in split_utf8(piece.raw))


def _quoted(s: str) -> str:
    return visible(s).replace('"', '\\"')


def complete_text(table: dict[int, TokenPiece], ids: Iterable[int], *, final: bool = True) -> str:
    """Text of a token sequence with characters assembled across tokens.

    Special tokens are left out (as the engine's output text leaves them out).  With
    `final=False` a trailing incomplete character is held back instead of shown as U+FFFD."""
    raw = bytearray()
    parts: list[str] = []
    for tid in ids:
        p = table.get(tid)
        if p is None or p.special:
            continue
        if p.raw is None:
            parts.append(raw.decode("utf-8", errors="replace"))
            raw.clear()
            parts.append(p.text)
        else:
            raw += p.raw
    tail = bytes(raw)
    if not final:
        # hold back a partial character at the end: it completes with a later token
        cut = len(tail)
        for back in range(1, min(4, len(tail)) + 1):
            n = _utf8_len(tail[-back])
            if n:
                if n > back:
                    cut = len(tail) - back
                break
        tail = tail[:cut]
    parts.append(tail.decode("utf-8", errors="replace"))
    return "".join(parts)


@dataclass(frozen=True)
class CharGroup:
    """Consecutive tokens that together spell whole characters (one token, usually)."""

    ids: list[int]
    text: str  # the characters they make, or "" when they never complete


def group_by_character(table: dict[int, TokenPiece], ids: list[int]) -> list[CharGroup]:
    """Cut a token sequence where a character boundary falls between tokens.

    `北` = three byte-level tokens becomes one group; an English word piece is a group
    of one.  Shows which tokens a reader's character is made of."""
    groups: list[CharGroup] = []
    cur: list[int] = []
    raw = bytearray()
    for tid in ids:
        p = table.get(tid)
        cur.append(tid)
        if p is None or p.special or p.raw is None:
            if raw:  # an unterminated byte run before a non-byte token: flush it as is
                groups.append(CharGroup(cur[:-1], raw.decode("utf-8", errors="replace")))
                cur, raw = [tid], bytearray()
            groups.append(CharGroup(cur, label(p) if (p is None or p.special) else p.text))
            cur = []
            continue
        raw += p.raw
        if _at_boundary(bytes(raw)):
            groups.append(CharGroup(cur, raw.decode("utf-8", errors="replace")))
            cur, raw = [], bytearray()
    if cur:
        groups.append(CharGroup(cur, raw.decode("utf-8", errors="replace") if raw else ""))
    return groups


def _at_boundary(raw: bytes) -> bool:
    """True when `raw` ends at a character boundary (no partial sequence at its end)."""
    for back in range(1, min(4, len(raw)) + 1):
        n = _utf8_len(raw[-back])
        if n:
            return n <= back
        if not 0x80 <= raw[-back] <= 0xBF:  # neither lead nor continuation: invalid, cut here
            return True
    return True  # only continuation bytes seen (or empty): nothing more will complete them
