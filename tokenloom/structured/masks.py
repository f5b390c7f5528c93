"""A step's grammar bitmasks: filled on a worker thread while the model's forward runs,
then applied to the logits.

Which tokens a grammar allows next depends only on the tokens a request has already
accepted, so the runner can ask for every constrained row's mask before it starts the
forward and pick the masks up when the logits are ready: the grammar walk (xgrammar's
C++, run without the GIL) then costs the step nothing on a GPU, and on a CPU it uses
the time the engine thread spends waiting in the model's kernels.

    masks = StepMasks.start([row.grammar for row in rows])   # before the forward
    ...
    apply_grammar_masks(logits, states, masks)               # in the sampler, after it
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Sequence

import torch

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.structured.state import GrammarState

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _executor() -> ThreadPoolExecutor:
    """One worker for the whole process: a step's masks are one task, and steps are serial."""
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenloom-grammar-masks")
        return _pool


class StepMasks:
    """The bitmask (one row per sampled row of a step, all ones where unconstrained) being
    filled for the rows whose state is not None."""

    def __init__(self, states: Sequence[GrammarState | None]):
        self.states = list(states)
        self.rows = [i for i, s in enumerate(self.states) if s is not None]
        self._future: Future[torch.Tensor] | None = None

    @classmethod
    def start(cls, states: Sequence[GrammarState | None]) -> StepMasks | None:
        """Begin filling on the worker thread; None when no row is constrained."""
        masks = cls(states)
        if not masks.rows:
            return None
        masks._future = _executor().submit(masks._fill)
        return masks

    def _fill(self) -> torch.Tensor:
        import xgrammar as xgr

        vocab = self.states[self.rows[0]].vocab_size
        bitmask = xgr.allocate_token_bitmask(len(self.states), vocab)  # all ones: nothing masked
        for i in self.rows:
            self.states[i].fill_mask(bitmask, i)
        return bitmask

    def bitmask(self) -> torch.Tensor:
        """The filled bitmask (waits for the worker; re-raises what it raised)."""
        if self._future is None:
            return self._fill()
        return self._future.result()


def apply_grammar_masks(logits: torch.Tensor, states: Sequence[GrammarState | None],
                        masks: StepMasks | None = None) -> torch.Tensor:
    """Set to -inf, in place, every logit of row i that `states[i]`'s grammar does not allow
    next (rows whose state is None are untouched).  `masks`: the same rows' bitmask, already
    being filled while the forward ran (`StepMasks.start`); filled here when not given.
    Returns `logits`."""
    import xgrammar as xgr

    if masks is None:
        masks = StepMasks(states)
    rows = masks.rows
    if not rows:
        return logits
    bitmask = masks.bitmask()
    if logits.device.type == "cpu":
        # Ours: xgrammar's CPU path unpacks every bit of every row (tens of ms for a batch
        # of 32 over a 152k vocabulary); this one skips the all-ones words.
        return cpu_kernels.mask_logits_(logits, bitmask)
    bitmask = bitmask.to(logits.device, non_blocking=True)
    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[1], indices=rows)
    return logits
