"""Structured output for reasoning models: the grammar constrains the answer, not the thinking.

A model such as Qwen3 or DeepSeek-R1 writes `<think> ... </think>` before its answer.  A JSON
schema (or a forced tool call) is about the answer, so holding the thinking to it would both
break the model's reasoning and, for a schema, make the first token `{` where the model wants
`<think>`.  `ReasoningGate` wraps a request's `GrammarState` and lets every token through while
the model reasons; from the token after the end tag on, it is the grammar.  It is a
`GrammarState` to its callers (the step masks, the output processor), so nothing else changes.

    phase        mask                              accept(token)
    undecided    grammar's mask + the start tag     start tag -> reasoning; else -> answer (grammar takes it)
    reasoning    none (every token allowed)         end tag -> answer
    answer       grammar's mask                     the grammar's accept

Where the output starts (`ReasoningTags.starts_inside`): in the reasoning, in the answer, or
undecided (a model that thinks only when its first token is the start tag).
"""

from __future__ import annotations

from typing import Literal, Sequence

import torch

from tokenloom.sampling_params import ReasoningTags
from tokenloom.structured.state import GrammarState

Phase = Literal["undecided", "reasoning", "answer"]


def _allow(bitmask: torch.Tensor, row: int, token_id: int) -> None:
    """Set token_id's bit in an int32 xgrammar bitmask row (bit j of word j // 32)."""
    word, bit = divmod(token_id, 32)
    if word >= bitmask.shape[1]:
        return
    value = 1 << bit
    if value >= 2**31:  # int32: the top bit is the sign
        value -= 2**32
    bitmask[row, word] |= value


class ReasoningGate:
    """A `GrammarState` that starts constraining after the reasoning ends."""

    def __init__(self, inner: GrammarState, tags: ReasoningTags, prompt_token_ids: Sequence[int]):
        self.inner = inner
        self.tags = tags
        self.vocab_size = inner.vocab_size
        inside = tags.starts_inside(prompt_token_ids)
        self.phase: Phase = "undecided" if inside is None else ("reasoning" if inside else "answer")

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.phase == "reasoning":
            return  # the row stays all ones: nothing masked
        self.inner.fill_mask(bitmask, row)
        if self.phase == "undecided":
            _allow(bitmask, row, self.tags.start_token_id)

    def accept(self, token_id: int) -> bool:
        if self.phase == "reasoning":
            if token_id == self.tags.end_token_id:
                self.phase = "answer"
            return True
        if self.phase == "undecided":
            if token_id == self.tags.start_token_id:
                self.phase = "reasoning"
                return True
            self.phase = "answer"
        return self.inner.accept(token_id)

    @property
    def terminated(self) -> bool:
        return self.phase == "answer" and self.inner.terminated


def gate_grammar(state: GrammarState, tags: ReasoningTags | None,
                 prompt_token_ids: Sequence[int]) -> GrammarState | ReasoningGate:
    """`state` itself without reasoning tags, else gated behind the reasoning."""
    return state if tags is None else ReasoningGate(state, tags, prompt_token_ids)
