"""The sampler: logits of the rows that will emit a token -> the next token ids.

This is the seed's "选出下一个 token（如 greedy / sampling）" for a whole batch at once.
Per-request settings become per-row tensors, so one pass handles a batch that mixes
greedy and sampled requests.  Expensive transforms (full-vocabulary sort for top-p,
penalty count tables, logit bias and allow-lists, grammar masks) are only paid when some
row in the step asks for them.  Logprobs are those of the model's raw distribution, before any of
these transforms, as vLLM reports them by default.

Seeded requests draw their randomness from their own `torch.Generator`, so the same
seed gives the same tokens whatever else shares the batch.  The row settings, transforms
and draw are tokenloom/sampling/ (shared with the speculative verifier); this module
chains them into a step's `sample`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.runner.logprobs import logprob_rows
from tokenloom.sampling import (SamplingRow, apply_constraints, apply_min_tokens, apply_penalties, draw,
                                filter_logits)
from tokenloom.structured import StepMasks, apply_grammar_masks


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled token logprob, its rank, top-N [(token, logprob)]) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


@dataclass
class PendingSample:
    """A step's draw, still on the device: `token_ids` [rows] and the logprobs asked for.
    Nothing here has waited for the device; `finish` does (async scheduling feeds
    `token_ids` to the next step's inputs before that)."""

    token_ids: torch.Tensor
    asked: list[int]  # rows that asked for logprobs, and how many top tokens each
    top_n: list[int]
    found: object = None  # their LogprobRows (runner/logprobs.py)

    def finish(self) -> SamplerOutput:
        """The tokens and logprobs as Python values (waits for the device)."""
        lp_out: list = [None] * len(self.token_ids)
        for j, (i, n) in enumerate(zip(self.asked, self.top_n)):
            lp, rank, top = self.found.row(j)
            lp_out[i] = (lp, rank, top[:n])
        return SamplerOutput(token_ids=self.token_ids.tolist(), logprobs=lp_out)


# SamplingRow: tokenloom/sampling's, the runner builds them
__all__ = ["SamplingRow", "SamplerOutput", "PendingSample", "sample", "sample_start"]


def sample(logits: torch.Tensor, rows: list[SamplingRow], masks: StepMasks | None = None) -> SamplerOutput:
    """logits: [N, vocab], one row per entry of `rows`: float32, or the head's bfloat16 (a
    decode step's, runner/cuda_graphs.py), widened here unless every row only takes its
    argmax.  `masks`: the grammar rows' bitmask, started before the forward
    (`StepMasks.start`); filled here when None."""
    return sample_start(logits, rows, masks).finish()


def _argmax_only(r: SamplingRow) -> bool:
    """The row's token is its logits' argmax and nothing else reads them."""
    p = r.params
    return (p.greedy and p.logprobs is None and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and len(r.output_token_ids) >= p.min_tokens and not p.constrains_logits
            and r.grammar is None)


def sample_start(logits: torch.Tensor, rows: list[SamplingRow], masks: StepMasks | None = None) -> PendingSample:
    """`sample`, stopping before anything waits for the device: the tokens stay a tensor."""
    if logits.dtype != torch.float32 and not all(_argmax_only(r) for r in rows):
        logits = logits.float()  # exact; a greedy batch's argmax reads the head's dtype as it is
    raw = logits  # logprobs are the raw logits' (every change below works on a copy)

    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty for r in rows):
        logits = logits.clone()
        apply_penalties(logits, rows)
    if any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
        logits = logits.clone()
        apply_min_tokens(logits, rows)
    if any(r.params.constrains_logits for r in rows):
        logits = logits.clone()
        apply_constraints(logits, rows)
    if any(r.grammar is not None for r in rows):
        logits = apply_grammar_masks(logits.clone(), [r.grammar for r in rows], masks)

    sampled_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled_rows) < len(rows):
        tokens = cpu_kernels.argmax_rows(logits)  # greedy rows keep this
    else:  # every row samples: no pass over the logits for an argmax nobody keeps
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if sampled_rows:
        idx = torch.tensor(sampled_rows).to(logits.device, non_blocking=True)  # no wait for the device
        sub_rows = [rows[i] for i in sampled_rows]
        every = len(sampled_rows) == len(rows)  # then no copy of the rows is needed
        probs = filter_logits(logits if every else logits[idx], sub_rows).softmax(dim=-1)
        tokens[idx] = draw(probs, sub_rows)

    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    pending = PendingSample(tokens, asked, [rows[i].params.logprobs for i in asked])
    if asked:  # computed now: the raw logits may be overwritten by the next step before `finish`
        idx = torch.tensor(asked).to(raw.device, non_blocking=True)
        pending.found = logprob_rows(raw if len(asked) == len(rows) else raw[idx], tokens[idx],
                                     max(pending.top_n))
    return pending
