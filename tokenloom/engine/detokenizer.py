"""Incremental detokenization and stop strings.

Each decode step yields one token id; users want text.  Byte-level tokenizers can
split one character across tokens (a Chinese character is 3 UTF-8 bytes), so text is
released only once it is a complete character.  Fast tokenizers do this with the
tokenizers library's `DecodeStream` (a couple of microseconds per token, primed with
the prompt's last tokens so leading spaces come out right); other tokenizers decode a
short window (a few tokens of context + the new ones) and hold back text that still
ends in U+FFFD.  Stop strings are searched only in the region new text can touch, and
while stop strings are active the last `len(longest stop) - 1` characters are not
shown yet, so a stream never emits text that a stop string later removes.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

_CONTEXT_TOKENS = 5  # tokens of left context so tokenizers that drop leading spaces decode right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool,
                 stop: list[str], include_stop_str_in_output: bool):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""
        self.stop_holdback = max((len(s) for s in stop), default=1) - 1
        backend = getattr(tokenizer, "_tokenizer", None)  # the Rust tokenizer behind a fast HF tokenizer
        self._backend = backend
        self._stream = (DecodeStream(ids=list(self.ids), skip_special_tokens=skip_special_tokens)
                        if backend is not None else None)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip, clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str | None:
        """Append one token; returns the stop string that matched (text already cut), else None."""
        self.ids.append(token_id)
        if self._stream is not None:
            chunk = self._stream.step(self._backend, token_id)
            if chunk is None:
                return None
            before = len(self.text)
            self.text += chunk
            self.read_offset = len(self.ids)
            return self._check_stop(before)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        full = self._decode(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            before = len(self.text)
            self.text += full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return self._check_stop(before)
        return None

    def flush(self) -> None:
        """At the end, release any held-back partial character as U+FFFD."""
        if self.read_offset < len(self.ids):
            if self._stream is not None:  # DecodeStream keeps no offsets of ours: decode the tail
                tail = self.ids[self.read_offset:]
                self.text += self._backend.decode(tail, skip_special_tokens=self.skip) if tail else ""
                self.read_offset = len(self.ids)
                return
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            full = self._decode(self.ids[self.prefix_offset :])
            self.text += full[len(prefix) :]
            self.read_offset = len(self.ids)

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
