"""Beam search over the engine's own beams: transformers' algorithm, step for step.

A beam-search request keeps `beam_width` (B) sequences -- beams -- alive.  Each engine step
computes one token of every beam (one forward pass for the whole batch, as for any
decode) and the runner returns each beam's K most likely next tokens with their
log-probabilities (K = max(2, 1 + number of EOS ids) x B: enough that B of the best K
never end at once).  `BeamSearch.step` then does what transformers'
`generate(num_beams=B, do_sample=False)` does with the same numbers:

  1. every candidate scores its beam's summed log-probability plus its own; the K best
     over all beams are kept;
  2. a candidate that ends its sequence (an EOS token, or max_tokens reached) and is among
     the B best becomes a finished hypothesis scored
         summed log-probability / (generated tokens) ** length_penalty
     and the B best finished hypotheses are kept;
  3. the B best candidates that do not end become the next beams;
  4. the search stops when every candidate ends, when `early_stopping` is True and B
     hypotheses are finished, or when no beam can still beat the worst finished hypothesis
     -- judged, as transformers does, by the best beam's score normalised by its current
     length (`early_stopping=False`) or by max_tokens ("never", for a positive penalty).

Scores are summed and divided in float32, as transformers' tensors do, so near-ties break
the same way.  `BeamGroup` maps the search onto scheduler requests: beam i of a step is
the request in slot i, and moving it onto its parent's sequence is a fork (the scheduler's
`fork_beams`: tokens copied, KV blocks shared copy-on-write).  A step in which only some of
the beams produced candidates (one was preempted, or evicted while paused) cannot be
scored like transformers' lock-step batch: the search restarts from its prompt -- it is
deterministic, so it reaches the same result, and the prompt's full KV blocks usually come
back from the prefix cache.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from tokenloom.request import Request, RequestStatus
from tokenloom.sampling_params import BeamSearchParams

MAX_RESTARTS = 16
"""Restarts (see the module docstring) a search may take before it fails: one that keeps
losing beams to preemption is told so instead of recomputing forever."""


@dataclass
class Hypothesis:
    """A finished sequence: its generated tokens, summed log-probability and score."""

    tokens: list[int]
    cum_logprob: float
    score: float
    finish_reason: str  # "stop" (ended with an EOS id) | "length"


def _f32(x: float) -> np.float32:
    return np.float32(x)


class BeamSearch:
    """The search of one prompt (transformers' semantics; see the module docstring)."""

    def __init__(self, params: BeamSearchParams, eos_token_ids: frozenset[int]):
        self.params = params
        self.width = params.beam_width
        self.eos = frozenset() if params.ignore_eos else frozenset(eos_token_ids)
        self.keep = max(2, 1 + len(self.eos)) * self.width  # candidates kept per step
        self.scores: list[float] = [0.0]  # summed log-probability of each live beam
        self.tokens: list[list[int]] = [[]]  # generated tokens of each live beam
        self.finished: list[Hypothesis] = []  # best first, at most `width`
        self.improvable = True  # transformers' "early stop heuristic unsatisfied"
        self.num_generated = 0
        self.done = False

    def step(self, candidates: list[tuple[list[int], list[float]]]) -> list[tuple[int, int]]:
        """`candidates[b]`: live beam b's most likely next tokens and their log-probabilities.
        Returns the next beams as (parent beam, token), best first; [] once `done`."""
        if self.done:
            raise RuntimeError("the beam search is over")
        if len(candidates) != len(self.scores):
            raise ValueError(f"candidates for {len(candidates)} beams, {len(self.scores)} are alive")
        p = self.params
        pool = []
        for b, (ids, lps) in enumerate(candidates):
            base = _f32(self.scores[b])
            pool.extend((float(base + _f32(lp)), b, t) for t, lp in zip(ids, lps))
        top = sorted(pool, key=lambda c: (-c[0], c[1], c[2]))[:self.keep]
        gen = self.num_generated + 1
        ends = [gen >= p.max_tokens or tok in self.eos for _, _, tok in top]

        # finished hypotheses: the ending ones among the `width` best candidates
        full = len(self.finished) == self.width
        if self.improvable and not (full and p.early_stopping is True):
            denom = _f32(gen ** p.length_penalty)
            new = [Hypothesis(self.tokens[b] + [tok], acc, float(_f32(acc) / denom),
                              "stop" if tok in self.eos else "length")
                   for (acc, b, tok), end in zip(top[:self.width], ends) if end]
            if new:
                merged = sorted(self.finished + new, key=lambda h: -h.score)  # stable: older first on ties
                self.finished = merged[:self.width]

        # the next beams: the best candidates that do not end
        masked = [float(_f32(acc) + _f32(-1e9)) if end else acc for (acc, _, _), end in zip(top, ends)]
        order = sorted(range(len(top)), key=lambda i: (-masked[i], i))[:self.width]
        self.num_generated = gen
        best = masked[order[0]] if order else float("-inf")
        if p.early_stopping == "never" and p.length_penalty > 0:
            best_len = p.max_tokens
        else:
            best_len = gen
        if len(self.finished) == self.width:
            possible = _f32(best) / _f32(best_len ** p.length_penalty)
            if not possible > min(h.score for h in self.finished):
                self.improvable = False
        all_finished = len(self.finished) == self.width
        self.done = (not self.improvable or (all_finished and p.early_stopping is True) or all(ends)
                     or not order)
        if self.done:
            return []
        moves = [(top[i][1], top[i][2]) for i in order]
        self.tokens = [self.tokens[b] + [tok] for b, tok in moves]
        self.scores = [masked[i] for i in order]
        return moves

    def results(self) -> list[Hypothesis]:
        """The finished hypotheses, best first (`width` of them once the search is done)."""
        return list(self.finished)


@dataclass
class Fork:
    """Move each beam onto (parent, token): the scheduler's `fork_beams`."""

    moves: list[tuple[Request, Request, int]]


@dataclass
class Restart:
    """End `old` beams and queue `head` (the search from its prompt again) at the front."""

    old: list[Request]
    head: Request


@dataclass
class BeamGroup:
    """One beam-search request's beams as scheduler requests, and its search."""

    params: BeamSearchParams
    eos_token_ids: frozenset[int]
    new_request: Callable[[int], Request]  # slot index -> a fresh request for that beam
    slots: list[Request] = field(default_factory=list)  # live beams, in the search's order
    search: BeamSearch | None = None
    restarts: int = 0
    _got: dict[str, tuple[list[int], list[float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.search = BeamSearch(self.params, self.eos_token_ids)
        self.slots = [self.new_request(0)]

    @property
    def topk(self) -> int:
        return self.search.keep

    def collect(self, req: Request, candidates: tuple[list[int], list[float]] | None) -> None:
        """A beam's candidates from this step (None: it computed a prompt chunk only)."""
        if candidates is not None:
            self._got[req.request_id] = candidates

    def advance(self) -> Fork | Restart | None:
        """After a step: the beams' next move, or None when no beam produced candidates (a
        prompt still being computed) or the search just ended (`search.done`)."""
        got, self._got = self._got, {}
        if not got:
            return None
        if set(got) != {r.request_id for r in self.slots}:
            return self.restart()
        moves = self.search.step([got[r.request_id] for r in self.slots])
        if not moves:
            return None
        parents = list(self.slots)
        while len(self.slots) < len(moves):
            self.slots.append(self.new_request(len(self.slots)))
        return Fork([(self.slots[i], parents[b], tok) for i, (b, tok) in enumerate(moves)])

    def restart(self) -> Restart:
        """Start over from the prompt with a fresh first beam (see the module docstring)."""
        self.restarts += 1
        if self.restarts > MAX_RESTARTS:
            raise RuntimeError(f"the beam search restarted {MAX_RESTARTS} times: its beams keep being preempted "
                               f"(too little KV cache or too many seats taken for beam_width {self.params.beam_width})")
        old = list(self.slots)
        self.search = BeamSearch(self.params, self.eos_token_ids)
        self.slots = [self.new_request(0)]
        return Restart(old, self.slots[0])


def beam_request(template: Request, index: int, width: int, topk: int) -> Request:
    """Slot `index`'s request, made from the first beam's settings: a fresh sequence of the
    prompt (the first beam holds a seat for every beam it will fork into)."""
    return dataclasses.replace(
        template, request_id=f"{template.request_id.rpartition('-beam')[0]}-beam{index}", output_token_ids=[],
        status=RequestStatus.WAITING, stop_reason=None, num_computed_tokens=0, num_cached_tokens=-1,
        block_hashes=[], spec_token_ids=[], beam_topk=topk, seats=width if index == 0 else 1,
        first_scheduled_time=None, first_token_time=None, last_token_time=None, finished_time=None,
        num_preemptions=0, chunked=False, paused=False)
