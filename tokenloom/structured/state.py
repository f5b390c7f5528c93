"""One request's position in its grammar.

Each step the state writes the tokens that may come next into one row of a bitmask (one bit
per token of the model's vocabulary; `structured.masks` applies it).  The engine calls
`accept` with the token it appended; a state that reached the end of its grammar (it
accepted a stop token) is `terminated`.
"""

from __future__ import annotations

from typing import Any

import torch


class GrammarState:
    """Wraps an xgrammar GrammarMatcher for one request."""

    def __init__(self, compiled: Any, vocab_size: int):
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(compiled)
        self.vocab_size = vocab_size

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]`."""
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar does not allow it."""
        return self._matcher.accept_token(token_id)

    @property
    def terminated(self) -> bool:
        return self._matcher.is_terminated()
