"""Before each step: give every running decode its n-gram drafts (or none).

The engine calls `SpecProposer.propose(scheduler.running)` right before `schedule()`; the
scheduler then feeds each request's `spec_token_ids` after its last token.  Drafting stops
in steps with more than `disable_by_batch_size` running requests, where verifying guesses
costs more than it saves, and for requests whose sampling settings are not exact under
verification (`verify.speculation_allowed`).

Pure Python + numpy (no torch): what the scheduler needs to stay testable without a model.
"""

from __future__ import annotations

from typing import Sequence

from tokenloom.request import Request
from tokenloom.spec_decode.config import SpeculativeConfig
from tokenloom.spec_decode.ngram import propose_ngram


def speculation_allowed(req: Request) -> bool:
    """True when drafting for req keeps its outputs exact and complete: every per-row
    sampling setting must be the same for all draft positions (no penalties, no pending
    min_tokens, no grammar), and per-token logprobs and seeded generators are not part of
    verification (their requests decode one token a step).  A beam of a beam search takes no
    drafts: its next token is the search's to choose."""
    p = req.sampling_params
    return (req.samples_tokens and req.grammar is None and p.logprobs is None and p.seed is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and req.num_output_tokens >= p.min_tokens)


class SpecProposer:
    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.enabled_last_step = False  # whether the last call drafted at all (batch size small enough)

    def active(self, num_running: int) -> bool:
        """Whether a step with `num_running` running requests drafts at all."""
        return num_running <= self.config.disable_by_batch_size

    def propose(self, running: Sequence[Request]) -> None:
        """Set `spec_token_ids` on every running request (empty where nothing is proposed)."""
        c = self.config
        on = self.active(len(running))
        self.enabled_last_step = on
        for req in running:
            drafts: list[int] = []
            # A decode (one token behind) that may emit more than one token before max_tokens.
            room = req.max_tokens - req.num_output_tokens - 1
            if on and room > 0 and req.num_tokens - req.num_computed_tokens == 1 and speculation_allowed(req):
                drafts = propose_ngram(req.all_token_ids, min(c.num_speculative_tokens, room),
                                       c.prompt_lookup_max, c.prompt_lookup_min)
            req.spec_token_ids = drafts
