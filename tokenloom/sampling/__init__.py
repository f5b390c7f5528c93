"""The pieces of sampling that more than one caller needs: a row's settings and the logit
transforms and the draw that turn a row of logits into a token.

The runner's sampler (runner/sampler.py `sample`) chains them for ordinary steps; the
speculative verifier (spec_decode/verify.py) applies the same constraints and filters to
the rows at each draft and draws from them, so a verified token is distributed exactly as
an ordinary step's.  Both stand on this module; it stands on nothing above the kernels.
Every transform works on the rows it is given, in place where it says so.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured import GrammarState

__all__ = ["SamplingRow", "apply_penalties", "apply_min_tokens", "apply_constraints", "top_p_filter",
           "filter_logits", "draw", "TOP_P_CANDIDATES"]


@dataclass
class SamplingRow:
    """One row of the step's logits and what that request asks of it."""

    request_id: str
    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    eos_token_ids: frozenset[int]
    generator: torch.Generator | None
    grammar: GrammarState | None = None  # structured output: only tokens its grammar allows next


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab = logits.shape[1]
    dev = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(r.prompt_token_ids) | set(r.output_token_ids)), device=dev, dtype=torch.long)
            seen = seen[seen < vocab]
            vals = logits[i, seen]
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and r.output_token_ids:
            out = torch.tensor(r.output_token_ids, device=dev, dtype=torch.long)
            counts = torch.zeros(vocab, device=dev, dtype=logits.dtype).scatter_add_(0, out, torch.ones_like(out, dtype=logits.dtype))
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned |= r.eos_token_ids
            ids = [t for t in banned if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


def apply_constraints(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """logit_bias (added to the raw logit, as OpenAI does) and allowed_token_ids (every
    other token masked), applied before greedy or sampled choice."""
    dev = logits.device
    for i, r in enumerate(rows):
        p = r.params
        if p.allowed_token_ids is not None:
            keep = torch.full((logits.shape[1],), True, device=dev)
            keep[torch.tensor(p.allowed_token_ids, device=dev, dtype=torch.long)] = False
            logits[i].masked_fill_(keep, float("-inf"))
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), device=dev, dtype=torch.long)
            logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=dev, dtype=logits.dtype)


# Without our CPU kernel, top-p looks for each row's nucleus among its most likely tokens
# first (a partial sort of 1,024 tokens), and sorts the whole vocabulary only where the nucleus
# lies past them (flat distributions).
TOP_P_CANDIDATES = 1024


def top_p_filter(logits: torch.Tensor, top_p: torch.Tensor, candidates: int = TOP_P_CANDIDATES,
           kernel: bool = True) -> torch.Tensor:
    """Keep each row's smallest set of most likely tokens whose mass reaches its top_p
    [N, 1]: a token is dropped when the mass strictly before it, in descending order,
    already reaches top_p (so the top token always stays).  On CPUs our kernel finds each
    row's line without sorting, in place (kernels/cpu_sampling.cpp: masses in float64, tokens
    of equal probability in index order); elsewhere (or `kernel=False`) rows whose nucleus is
    not within their top `candidates` sort their whole vocabulary."""
    probs = logits.softmax(dim=1)
    if kernel and cpu_kernels.top_p_mask(logits, probs, top_p.squeeze(1)) is not None:
        return logits
    vals, order = probs.topk(min(candidates, probs.shape[1]), dim=1)  # descending
    cum = vals.cumsum(dim=1)
    keep = torch.zeros_like(probs, dtype=torch.bool)
    keep.scatter_(1, order, (cum - vals) < top_p)
    wide = (cum[:, -1:] < top_p).squeeze(1).nonzero().squeeze(1)  # the candidates' mass falls short
    if wide.numel():
        vals, order = probs[wide].sort(dim=1, descending=True)
        cum = vals.cumsum(dim=1)
        keep[wide] = torch.zeros_like(vals, dtype=torch.bool).scatter_(1, order, (cum - vals) < top_p[wide])
    return logits.masked_fill(~keep, float("-inf"))


def filter_logits(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p on the sampled (non-greedy) rows."""
    dev = logits.device
    temps = torch.tensor([r.params.temperature for r in rows], device=dev, dtype=logits.dtype)
    logits = logits / temps.unsqueeze(1)
    ks = [r.params.top_k for r in rows]
    if any(ks) and cpu_kernels.top_k_mask(logits, torch.tensor(ks)) is None:
        vocab = logits.shape[1]
        kmax = min(max(ks), vocab)
        top_vals = logits.topk(kmax, dim=1).values
        k_idx = torch.tensor([min(k, vocab) - 1 if k else kmax - 1 for k in ks], device=dev)
        thresh = top_vals.gather(1, k_idx.unsqueeze(1))
        active = torch.tensor([bool(k) for k in ks], device=dev).unsqueeze(1)
        logits = torch.where(active & (logits < thresh), float("-inf"), logits)
    ps = [r.params.top_p for r in rows]
    if any(p < 1.0 for p in ps):
        logits = top_p_filter(logits, torch.tensor(ps, device=dev, dtype=logits.dtype).unsqueeze(1))
    mins = [r.params.min_p for r in rows]
    if any(mins):
        probs = logits.softmax(dim=1)
        min_p = torch.tensor(mins, device=dev, dtype=probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, float("-inf"))
    return logits


def draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of `probs` [N, vocab], drawn from that row's distribution by
    inverting its CDF at one uniform number, taken from the row's own generator.

    One random number per row, not one per vocabulary entry: the exponential race
    argmax(p / E), E ~ Exp(1) (and torch.multinomial, which draws the same way) draws one
    exponential per vocabulary entry, which on a CPU costs far more than the CDF's one
    cumulative sum (accumulated in float64 by PyTorch on CPU); docs/performance.md has the
    timings."""
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=r.generator, device=cdf.device) for r in rows])
    target = (u * cdf[:, -1]).unsqueeze(1)
    # The first token whose cumulative mass exceeds the target: tokens of zero probability
    # (filtered out) add no mass, so they are never chosen.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)
