"""Verification: the target model's logits at every draft position decide what is kept.

A step fed a decode request its last token t0 followed by its drafts d1..dk, so the model
produced k+1 rows of logits: row j is the distribution of the token after d_j (row 0:
after t0).  Walking the rows in order:

  * greedy: keep d_{j+1} while it equals row j's argmax; at the first mismatch emit the
    argmax instead and stop; if all k are kept, row k's argmax is a free extra ("bonus")
    token.  The output is exactly what k+1 ordinary greedy steps would have produced.
  * sampling: the n-gram drafter proposes a single token with certainty (its distribution
    q is a point mass), so the standard rejection rule -- accept with min(1, p(d)/q(d)) --
    becomes *accept d with probability p(d)*; on rejection draw from p with d removed and
    renormalised (max(0, p - q) normalised).  Every emitted token is then distributed
    exactly as p, the distribution an ordinary step samples from (after temperature,
    top-k/top-p/min-p, logit_bias and allowed_token_ids).

Only requests whose per-row settings do not depend on the tokens before them are
verified here (no penalties, no min_tokens pending, no grammar, no logprobs, no seed):
the proposer drafts for no other (`proposer.speculation_allowed`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.sampling import SamplingRow, apply_constraints, draw, filter_logits


@dataclass
class Verified:
    """One request's outcome: the drafts kept (a prefix of its drafts) and the token after them."""

    accepted: list[int]
    token: int


def verify(logits: torch.Tensor, rows: list[SamplingRow], drafts: list[list[int]]) -> list[Verified]:
    """logits: [sum(len(d) + 1 for d in drafts), vocab], request i's rows consecutive, float32
    or the head's dtype (a step replayed from the decode graphs); rows[i] holds request i's
    settings.  Returns one Verified per request."""
    n_rows = [len(d) + 1 for d in drafts]
    flat_rows = [r for r, n in zip(rows, n_rows) for _ in range(n)]
    if logits.dtype != torch.float32 and not all(r.params.greedy and not r.params.constrains_logits for r in rows):
        logits = logits.float()  # exact; greedy rows' argmax reads the head's dtype (a replayed step's) as it is
    if any(r.params.constrains_logits for r in rows):
        logits = logits.clone()
        apply_constraints(logits, flat_rows)
    out: list[Verified] = []
    greedy_top = cpu_kernels.argmax_rows(logits).tolist()
    sampled_idx = [i for i, r in enumerate(flat_rows) if not r.params.greedy]
    probs = None
    if sampled_idx:
        idx = torch.tensor(sampled_idx, device=logits.device)
        probs = filter_logits(logits[idx], [flat_rows[i] for i in sampled_idx]).softmax(dim=-1)
    where = {row: k for k, row in enumerate(sampled_idx)}  # flat row -> its row in probs
    start = 0
    for row, d, n in zip(rows, drafts, n_rows):
        if row.params.greedy:
            out.append(_verify_greedy(greedy_top[start:start + n], d))
        else:
            out.append(_verify_sampled(probs[where[start]:where[start] + n], d, row))
        start += n
    return out


def _verify_greedy(top: list[int], draft: list[int]) -> Verified:
    a = 0
    while a < len(draft) and draft[a] == top[a]:
        a += 1
    return Verified(draft[:a], top[a])


def _verify_sampled(probs: torch.Tensor, draft: list[int], row: SamplingRow) -> Verified:
    """probs: [len(draft) + 1, vocab], the target distributions at each position."""
    k = len(draft)
    if k:
        p_draft = probs[torch.arange(k, device=probs.device), torch.tensor(draft, device=probs.device)].tolist()
        u = torch.rand(k, generator=row.generator, device=probs.device).tolist()
        for j in range(k):
            if u[j] >= p_draft[j]:  # rejected: draw from p without the draft token
                residual = probs[j:j + 1].clone()
                residual[0, draft[j]] = 0.0
                return Verified(draft[:j], int(draw(residual, [row])[0]))
    return Verified(list(draft), int(draw(probs[k:k + 1], [row])[0]))
