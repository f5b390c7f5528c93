"""One request's position in its grammar, and the per-step masking of a batch's logits.

The sampler calls `apply_grammar_masks` on the rows of the step that carry a state: each
state writes the tokens that may come next into one row of a bitmask (one bit per token of
the model's vocabulary), and xgrammar's kernel sets every other logit to -inf, on whatever
device the logits live.  The engine calls `accept` with the token it appended; a state that
reached the end of its grammar (it accepted a stop token) is `terminated`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Sequence

import torch

if TYPE_CHECKING:
    from tokenloom.structured.masks import StepMasks


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


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[GrammarState | None],
                        masks: "StepMasks | None" = None) -> torch.Tensor:
    """Set to -inf, in place, every logit of row i that `states[i]`'s grammar does not allow
    next (rows whose state is None are untouched).  `masks`: the same rows' bitmask, already
    being filled while the forward ran (`StepMasks.start`); filled here when not given.
    Returns `logits`."""
    import xgrammar as xgr

    from tokenloom.structured.masks import StepMasks

    if masks is None:
        masks = StepMasks(states)
    rows = masks.rows
    if not rows:
        return logits
    bitmask = masks.bitmask()
    if logits.device.type == "cpu":
        # Ours: xgrammar's CPU path unpacks every bit of every row (tens of ms for a batch
        # of 32 over a 152k vocabulary); this one skips the all-ones words.
        from tokenloom.kernels import cpu as cpu_kernels

        return cpu_kernels.mask_logits_(logits, bitmask)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    return logits
