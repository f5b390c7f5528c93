"""Incremental detokenization and stop strings.

Each decode step yields one token id; users want text, streamed as it is made, and the
streamed pieces must add up to exactly the text of the whole answer.  Three things make
that harder than decoding one token at a time:

* **Context.**  A token's text depends on its left neighbours: SentencePiece's "▁the" is
  " the" after a word but "the" at the start (its decoder strips one leading space),
  WordPiece's "##ing" joins the word before it.  So ids are decoded in a short *window*
  `ids[prefix_offset:]`; the window's first part, `ids[prefix_offset:read_offset]`, was
  already shown, and what the whole window decodes to beyond that part's text is new.
  A request's window starts with a few of its prompt's tokens, so its first token gets
  the same spacing it has in prompt + answer.
* **Characters split over tokens.**  Byte-level tokenizers split a Chinese character
  (3 UTF-8 bytes) or an emoji (4) over tokens; until the last byte arrives the window
  ends in U+FFFD, and nothing is released.  Byte-fallback tokenizers (Llama-2, Mistral,
  TinyLlama: `<0xE4>`-style tokens, decoder ByteFallback) are stricter: tokenizers decodes
  a *run* of byte tokens at once and, when the run as a whole is not valid UTF-8, prints
  every byte of it as U+FFFD -- a stray byte can turn characters already formed back into
  replacement characters.  So while the last token that reaches the decoder is a byte
  token, text is held, until the run ends or `_MAX_HELD_TOKENS` tokens wait (then the run
  is cut before its last lead byte, and the cut part is released as decoded so far).
* **Ids the tokenizer does not know.**  A model's vocabulary is often padded beyond its
  tokenizer's (Qwen2.5: 151,936 rows for 151,665 tokens) and sampling can pick a padding
  row.  Such an id contributes "" -- as tokenizers' own `decode` drops it -- and is never
  handed to the tokenizer.

The prompt context is chosen to begin a window cleanly: the prompt's last tokens, cut so
that the context ends on a complete character outside any byte run (a prompt given as ids
can stop mid-character; that partial character stays the prompt's, and the answer's bytes
are decoded without it); its first token may start mid-character, which is harmless
because the context's own text is subtracted.  Windows slide forward to their last visible
token every few tokens, never to a skipped special token (the token after it would be
decoded as if it began the text).  Should a window ever decode to text that does not extend
what it showed before (a decoder that is not prefix-stable), the new tokens are decoded on
their own instead: the detokenizer never raises for any id sequence.  With an empty prompt
the released text is exactly `tokenizer.decode(ids, skip_special_tokens=...,
clean_up_tokenization_spaces=False)` (runs longer than `_MAX_HELD_TOKENS` byte tokens aside).

Fast path: for a plain byte-level decoder (GPT-2, Llama-3, Qwen), where none of the above
but split characters applies, tokenizers' own `DecodeStream` does the same work in one call
per token, primed with the clean context.  If it ever raises (tokenizers' "Invalid prefix")
or holds too many tokens, the request moves to the window path from its last shown token.

Stop strings are searched only in the region new text can touch, and while stop strings
are active the last `len(longest stop) - 1` characters are not shown yet, so a stream
never emits text that a stop string later removes.

`TokenTexts` reuses the same machinery for logprobs: each token's string is the text it
contributes in context, so the strings of a sequence concatenate to its text.
"""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

try:
    from tokenizers.decoders import DecodeStream as _DecodeStream
except ImportError:  # tokenizers older than DecodeStream: the window path serves everyone
    _DecodeStream = None

_REPLACEMENT = "\ufffd"
_CONTEXT_TOKENS = 4  # most prompt tokens taken as left context (their text is subtracted)
_MAX_TRIM = 4  # a partial UTF-8 character spans at most 3 bytes, so at most 3 tokens (+1 spare)
_MAX_WINDOW = 4  # a window longer than this (in shown tokens) slides to its last visible one
_MAX_HELD_TOKENS = 64  # bound on tokens held back (and so on the window re-decoded per step)
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@dataclass(frozen=True)
class TokenizerFacts:
    """What detokenization needs to know about a tokenizer, computed once per tokenizer."""

    decode: Callable[[Sequence[int], bool], str]  # (ids, skip_special_tokens) -> text, no clean-up
    known: frozenset[int]  # ids that map to a token; any other id decodes to ""
    special_ids: frozenset[int]  # ids dropped by skip_special_tokens=True
    byte_values: dict[int, int]  # byte-fallback token id -> its byte; empty unless the decoder has ByteFallback
    backend: Any = None  # the Rust tokenizer, where tokenizers' own DecodeStream may serve (plain ByteLevel decoder)
    spacer: int | None = None  # an ordinary token with plain text of its own, to stand in as left context


_FACTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def tokenizer_facts(tokenizer) -> TokenizerFacts:
    """The (cached) `TokenizerFacts` of a Hugging Face tokenizer, fast or slow."""
    try:
        return _FACTS[tokenizer]
    except (KeyError, TypeError):
        pass
    backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer behind a fast HF tokenizer
    facts = _fast_facts(backend) if backend is not None else _slow_facts(tokenizer)
    try:
        _FACTS[tokenizer] = facts
    except TypeError:  # not weak-referenceable: recomputed next time
        pass
    return facts


def _fast_facts(backend) -> TokenizerFacts:
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=True)
    specials = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
    decoder = json.loads(backend.decoder.__getstate__()) if backend.decoder is not None else {}
    byte_values: dict[int, int] = {}
    if "ByteFallback" in json.dumps(decoder):
        for tok, i in vocab.items():
            m = _BYTE_TOKEN.fullmatch(tok)
            if m is not None and i not in specials:
                byte_values[i] = int(m.group(1), 16)
    # DecodeStream is exact for a plain byte-level decoder: no first-token rule (so a window
    # may start anywhere) and invalid bytes never spoil their neighbours.
    stream_ok = _DecodeStream is not None and decoder.get("type") == "ByteLevel"

    def decode(ids: Sequence[int], skip: bool) -> str:
        return backend.decode(ids, skip)

    known = frozenset(vocab.values())
    return TokenizerFacts(decode, known, specials, byte_values, backend if stream_ok else None,
                          _find_spacer(decode, known, specials | byte_values.keys()))


def _find_spacer(decode: Callable[[Sequence[int], bool], str], known: frozenset[int],
                 excluded: Iterable[int]) -> int | None:
    """The lowest ordinary token id whose text alone is plain ASCII (no space, no U+FFFD)."""
    excluded = set(excluded)
    for i in sorted(known)[:4096]:
        if i not in excluded:
            text = decode([i], False)
            if text.isascii() and text.strip() == text != "":
                return i
    return None


def _slow_facts(tokenizer) -> TokenizerFacts:
    known = frozenset(tokenizer.get_vocab().values())

    def decode(ids: Sequence[int], skip: bool) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=skip, clean_up_tokenization_spaces=False)

    specials = frozenset(tokenizer.all_special_ids)
    return TokenizerFacts(decode, known, specials, {}, None, _find_spacer(decode, known, specials))


class IncrementalDetokenizer:
    """Text of one generated sequence, released token by token (see the module docstring)."""

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool):
        self.facts = tokenizer_facts(tokenizer)
        self.skip = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.ids: list[int] = self._context(prompt_token_ids)  # known ids only
        self.prefix_offset = 0
        self.read_offset = len(self.ids)  # ids[:read_offset] are shown
        self._shown = self._decode(self.ids)  # text of ids[prefix_offset:read_offset]
        self._in_byte_run = False  # is the last token that reaches the decoder a byte token?
        self._stream = None
        if self.facts.backend is not None:
            try:
                self._stream = _DecodeStream(ids=list(self.ids), skip_special_tokens=self.skip)
            except TypeError:  # a tokenizers without primed streams: the window path serves
                self._stream = None
        self.text = ""
        self.stop_holdback = max((len(s) for s in stop), default=1) - 1

    # ---- context --------------------------------------------------------
    def _context(self, prompt: Sequence[int]) -> list[int]:
        """The prompt's last tokens, ending on a complete character outside a byte run."""
        f = self.facts
        # the last tokens the decoder sees: a prompt may end in more skipped special tokens (a
        # padding run) than the window holds, and its text must still stand before the answer
        ctx: list[int] = []
        for i in reversed(prompt):
            if i in f.known and not self._transparent(i):
                ctx.append(i)
                if len(ctx) == _CONTEXT_TOKENS + 2 * _MAX_TRIM:
                    break
        ctx.reverse()
        dropped_text, trimmed = False, 0
        while ctx:
            if self._transparent(ctx[-1]):
                ctx.pop()
            elif ctx[-1] in f.byte_values:
                ctx.pop()  # a byte run the answer continued would decode differently as a whole
                dropped_text = True
            elif trimmed < _MAX_TRIM and self._decode(ctx[-_CONTEXT_TOKENS:]).endswith(_REPLACEMENT):
                ctx.pop()  # the prompt ends inside a character: keep that partial character out
                dropped_text, trimmed = True, trimmed + 1
            else:
                break
        ctx = ctx[-_CONTEXT_TOKENS:]
        if self._decode(ctx).endswith(_REPLACEMENT):  # undecodable to the end: no context at all
            ctx, dropped_text = [], True
        if dropped_text and f.spacer is not None and all(self._transparent(i) for i in ctx):
            # Nothing of the prompt's text is left to stand before the answer, yet the answer
            # does not begin the text: a stand-in keeps its first token from being decoded
            # as the first (SentencePiece would strip its leading space).
            ctx = [f.spacer]
        return ctx

    def _transparent(self, tok: int) -> bool:
        """A token the decoder never sees (a special token while skipping them)."""
        return self.skip and tok in self.facts.special_ids

    def _decode(self, ids: Sequence[int]) -> str:
        return self.facts.decode(ids, self.skip) if ids else ""

    def _window_start(self, before: int) -> int:
        """Start for a window whose shown part ends at `before`: the last token there that the
        decoder sees.  A window must not begin with a skipped special token: its first visible
        token would be decoded as if it began the text (SentencePiece strips its space,
        WordPiece drops its join)."""
        for i in range(before - 1, -1, -1):
            if not self._transparent(self.ids[i]):
                return i
        return 0

    # ---- one token ------------------------------------------------------
    def push(self, token_id: int) -> str:
        """Append one token; returns the text released by it (often "", never raises)."""
        f = self.facts
        if token_id not in f.known:
            return ""
        ids = self.ids
        ids.append(token_id)
        if self._stream is not None:
            if len(ids) - self.read_offset <= _MAX_HELD_TOKENS:
                try:
                    chunk = self._stream.step(f.backend, token_id)
                except Exception:  # tokenizers' "Invalid prefix": the window path takes over
                    chunk = None
                    self._leave_stream()
                else:
                    if chunk is None:
                        return ""
                    self.read_offset = len(ids)
                    return chunk
            else:
                self._leave_stream()
        if not (self.skip and token_id in f.special_ids):
            self._in_byte_run = token_id in f.byte_values
        full = f.decode(ids[self.prefix_offset:], self.skip)
        if full.endswith(_REPLACEMENT) or self._in_byte_run:
            if len(ids) - self.read_offset < _MAX_HELD_TOKENS:
                return ""
            return self._force_release(full)
        return self._release(len(ids), full)

    def _leave_stream(self) -> None:
        """Hand over from DecodeStream to the window path: a window over the last shown token."""
        self._stream = None
        self.prefix_offset = self._window_start(self.read_offset)
        self._shown = self._decode(self.ids[self.prefix_offset:self.read_offset])

    def _release(self, end: int, full: str) -> str:
        """Show ids[read_offset:end]; `full` is the text of ids[prefix_offset:end]."""
        if full.startswith(self._shown):
            delta = full[len(self._shown):]
        else:  # not prefix-stable: take the new tokens on their own rather than fail
            delta = self._decode(self.ids[self.read_offset:end])
        self.read_offset, self._shown = end, full
        if end - self.prefix_offset > _MAX_WINDOW:  # slide: shorter windows decode faster
            start = self._window_start(end)
            if start > self.prefix_offset:
                self.prefix_offset = start
                self._shown = self._decode(self.ids[start:end])
        return delta

    def _force_release(self, full: str) -> str:
        """Too many tokens held: release them, in a byte run up to its last multi-byte lead
        byte, so the run's rest starts a fresh window on a character boundary (decoded after
        the released bytes, it would be re-read as one run with them)."""
        byte_values = self.facts.byte_values
        end = len(self.ids)
        if self._in_byte_run:
            for i in range(len(self.ids) - 1, self.read_offset, -1):
                if byte_values.get(self.ids[i], 0) >= 0xC0:
                    end = i
                    break
        if end == len(self.ids):
            return self._release(end, full)
        delta = self._release(end, self._decode(self.ids[self.prefix_offset:end]))
        self.prefix_offset, self._shown = end, ""
        return delta

    def peek(self, token_id: int) -> str:
        """The text `token_id` would add if it came next (for logprob alternatives); no state change."""
        if token_id not in self.facts.known:
            return ""
        start = self.prefix_offset if self._stream is None else self._window_start(self.read_offset)
        window = self.ids[start:]
        base = self._decode(window)  # held tokens included: the alternative would follow them
        full = self._decode(window + [token_id])
        return full[len(base):] if full.startswith(base) else self._decode([token_id])

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string that matched (text already cut), else None."""
        delta = self.push(token_id)
        if not delta:
            return None
        before = len(self.text)
        self.text += delta
        return self._check_stop(before)

    def finish(self) -> str:
        """Release whatever is still held (an unfinished character shows as U+FFFD); returns it."""
        if self.read_offset >= len(self.ids):
            return ""
        if self._stream is not None:
            self._leave_stream()
        return self._release(len(self.ids), self._decode(self.ids[self.prefix_offset:]))

    def flush(self) -> None:
        """At the end of the sequence, append what was held back to the text."""
        self.text += self.finish()

    # ---- stop strings ---------------------------------------------------
    def _check_stop(self, before: int) -> str | None:
        if not self.stop:
            return None
        start = max(0, before - self.stop_holdback)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        return s

    def visible_text(self, finished: bool) -> str:
        if finished or not self.stop_holdback:
            return self.text
        return self.text[: max(0, len(self.text) - self.stop_holdback)]


class TokenTexts:
    """Each token's string for logprobs: the text it contributes after `context_ids`.

    The strings of a sequence concatenate to exactly the text the engine streams for it
    (same detokenizer, same context), so OpenAI's `text_offset` indexes that text and
    SentencePiece tokens keep their leading space (" there", not "there").  A token that
    only starts a character gets "" and the token completing it the whole character; the
    text still held at the end goes to the last token (`finish`).  Alternatives get the
    text they would have added in the same place, so distinct tokens rarely share a key.
    """

    def __init__(self, tokenizer, context_ids: Sequence[int], skip_special_tokens: bool = True):
        self._detok = IncrementalDetokenizer(tokenizer, context_ids, skip_special_tokens, [], False)

    def next(self, token_id: int, alternatives: Iterable[int] = ()) -> tuple[str, dict[int, str]]:
        """(text of `token_id` here, {alternative id: its text here}); then moves past `token_id`."""
        alts = {a: self._detok.peek(a) for a in alternatives if a != token_id}
        return self._detok.push(token_id), alts

    def finish(self) -> str:
        """The text still held back once the sequence is over (belongs to its last token)."""
        return self._detok.finish()
