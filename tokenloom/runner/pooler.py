"""Pooling an embedding request's hidden states into one vector, chunk by chunk.

An embedding request is a prefill that the scheduler may split over several steps
(chunked prefill), each step computing some of its prompt rows.  What a chunk contributes
depends on the model's pooling (model/pooling_config.py): mean pooling adds every row to a
running sum, CLS pooling keeps the row of position 0, last-token pooling the row of the
last position.  When the chunk that reaches the end of the prompt arrives, the vector is
finished: the running sum divided by the prompt length (mean), cut to the request's
`dimensions` and normalised to unit length if the model (or the request) says so.

The rows handed in are the model's final hidden states after its final norm (what
sentence-transformers' Transformer module returns), in float32.  A request that restarts
from position 0 (preempted, recomputed) starts its sum afresh.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.core.scheduler import ScheduledRequest
from tokenloom.model.pooling_config import PoolingConfig


@dataclass
class _Partial:
    total: torch.Tensor | None = None  # mean: the sum so far; cls: the first row
    rows: int = 0


class Pooler:
    def __init__(self, config: PoolingConfig):
        self.config = config
        self._partial: dict[str, _Partial] = {}

    def rows(self, s: ScheduledRequest, offset: int) -> list[int]:
        """Which rows of the step's hidden states (this request's chunk starts at `offset`)
        the pooling reads."""
        n, mode = s.num_new_tokens, self.config.mode
        if mode == "mean":
            return list(range(offset, offset + n))
        if mode == "cls":
            return [offset] if s.num_computed_before == 0 else []
        return [offset + n - 1] if s.sample else []

    def feed(self, s: ScheduledRequest, hidden: torch.Tensor) -> torch.Tensor | None:
        """Take this chunk's rows (`rows` order, after the final norm); the finished vector
        (float32, on the CPU) when the chunk ends the prompt, else None."""
        rid = s.request_id
        if s.num_computed_before == 0:
            self._partial.pop(rid, None)  # a fresh start (also after a preemption)
        part = self._partial.setdefault(rid, _Partial())
        hidden = hidden.float()
        if self.config.mode == "mean":
            chunk = hidden.sum(dim=0)
            part.total = chunk if part.total is None else part.total + chunk
            part.rows += hidden.shape[0]
        elif self.config.mode == "cls":
            if len(hidden):
                part.total = hidden[0]
        elif s.sample:
            part.total = hidden[-1]
        if not s.sample:
            return None
        del self._partial[rid]
        if part.total is None:
            raise RuntimeError(f"request {rid}: pooled no row (its prompt was not computed from its start)")
        vec = part.total / part.rows if self.config.mode == "mean" else part.total
        p = s.request.pooling
        if p is not None and p.dimensions is not None:
            vec = vec[:p.dimensions]
        normalize = self.config.normalize if p is None or p.normalize is None else p.normalize
        if normalize:
            vec = torch.nn.functional.normalize(vec, p=2, dim=0)
        return vec.cpu()

    def forget(self, request_id: str) -> None:
        self._partial.pop(request_id, None)
