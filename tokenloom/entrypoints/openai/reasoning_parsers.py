"""Reasoning output: a thinking model's `<think> ... </think>` apart from its answer.

`--reasoning-parser qwen3|deepseek_r1` splits a chat answer into `reasoning_content` (vLLM's
field: the text between the tags) and `content` (what follows, leading newlines dropped), in
the whole message and in stream deltas (reasoning deltas first, then content ones).  The
Responses API gives the same split as a `reasoning` output item.

- `qwen3`: the model reasons only when it writes `<think>` first (Qwen3 with
  `enable_thinking` off answers at once, its template having closed the tags already).
- `deepseek_r1`: the model starts inside the reasoning even when it does not write `<think>`
  (DeepSeek-R1's template opens it in the prompt); all text before `</think>` is reasoning,
  and an answer cut off before `</think>` is reasoning only (content null).

For both, a tag at the very end of the prompt counts first (`ReasoningTags.starts_inside`): a
template that ends the prompt with an open `<think>` starts the output inside, one that closed
it (`<think></think>`, thinking switched off) starts it in the answer.  The same rule, on token
ids, gates structured output (structured/reasoning_gate.py), so a JSON schema or a forced tool
call constrains the answer and tool calls are read from the answer alone.  Both tags must be single tokens of the vocabulary (checked at start-up), which
they are in the models these parsers are for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenloom.sampling_params import ReasoningTags

REASONING_PARSERS = ("qwen3", "deepseek_r1")
START, END = "<think>", "</think>"


def _partial_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `tag` (held back while
    streaming: it may become the tag)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-k:]):
            return k
    return 0


@dataclass(frozen=True)
class ReasoningParser:
    """Splits output text into (reasoning, content); `tags` are the same tags as token ids."""

    name: str
    tags: ReasoningTags

    def split(self, text: str, inside: bool | None, *, final: bool = True) -> tuple[str | None, str | None]:
        """(reasoning, content) of `text`, an output that starts inside the reasoning
        (`inside` True), in the answer (False) or undecided (None: only a leading `<think>`
        opens it).  None where there is no such part.  `final` False: the text may still
        grow, so a tail that may become a tag is held back from both parts, and the parts
        only ever grow as the text does (stream deltas are their new ends)."""
        if inside is None:
            if text.startswith(START):
                inside, text = True, text[len(START):]
            elif not final and START.startswith(text):
                return None, None  # may yet be "<think>"
            else:
                inside = False
        elif inside and text.startswith(START):  # a model that writes the tag its template already opened
            text = text[len(START):]
        elif inside and not final and text and START.startswith(text):
            return "", None  # may yet be that tag
        if not inside:
            return None, text
        end = text.find(END)
        if end < 0:
            hold = 0 if final else _partial_tail(text, END)
            return text[:len(text) - hold], None
        answer = text[end + len(END):].lstrip("\n")
        return text[:end], answer if (answer or final) else None

    def starts_inside(self, prompt_token_ids: list[int]) -> bool | None:
        return self.tags.starts_inside(prompt_token_ids)

    def reasoning_tokens(self, token_ids: list[int], inside: bool | None) -> int:
        """How many of the output's tokens belong to the reasoning (the tags included)."""
        if inside is None:
            if not token_ids or token_ids[0] != self.tags.start_token_id:
                return 0
        elif not inside:
            return 0
        try:
            return token_ids.index(self.tags.end_token_id) + 1
        except ValueError:
            return len(token_ids)


def _single_token(tokenizer: Any, tag: str) -> int:
    ids = tokenizer.encode(tag, add_special_tokens=False)
    tid = tokenizer.convert_tokens_to_ids(tag)
    if len(ids) != 1 or ids[0] != tid:
        raise ValueError(f"--reasoning-parser: {tag!r} is not one token of this model's tokenizer (it encodes as "
                         f"{ids}); the parser is for models whose vocabulary has the think tags")
    if tid in set(getattr(tokenizer, "all_special_ids", ()) or ()):
        raise ValueError(f"--reasoning-parser: this tokenizer marks {tag!r} as a special token, so it would be "
                         f"dropped from the text (skip_special_tokens); the reasoning could not be found")
    return tid


def get_reasoning_parser(name: str, tokenizer: Any) -> ReasoningParser:
    """The parser called `name` for this tokenizer; ValueError naming --reasoning-parser when
    the name is unknown or the tokenizer lacks the tags."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: unknown parser {name!r} (choose from {', '.join(REASONING_PARSERS)})")
    tags = ReasoningTags(_single_token(tokenizer, START), _single_token(tokenizer, END),
                         implicit_start=name == "deepseek_r1")
    return ReasoningParser(name, tags)
