"""The sampler: logits of the rows that will emit a token -> the next token ids.

This is the seed's "选出下一个 token（如 greedy / sampling）" for a whole batch at once.
Per-request settings become per-row tensors, so one pass handles a batch that mixes
greedy and sampled requests.  Expensive transforms (full-vocabulary sort for top-p,
penalty count tables, logit bias and allow-lists, grammar masks) are only paid when some
row in the step asks for them.  Logprobs are those of the model's raw distribution, before any of
these transforms, as vLLM reports them by default.

Seeded requests draw their randomness from their own `torch.Generator`, so the same
seed gives the same tokens whatever else shares the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.runner.logprobs import logprob_rows
from tokenloom.sampling_params import SamplingParams
from tokenloom.structured import GrammarState, StepMasks, apply_grammar_masks


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


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # per row: (sampled token logprob, its rank, top-N [(token, logprob)]) or None
    logprobs: list[tuple[float, int, list[tuple[int, float]]] | None]


def _apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
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


def _apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    for i, r in enumerate(rows):
        p = r.params
        if len(r.output_token_ids) < p.min_tokens:
            banned = set(p.stop_token_ids)
            if not p.ignore_eos:
                banned |= r.eos_token_ids
            ids = [t for t in banned if t < logits.shape[1]]
            if ids:
                logits[i, ids] = float("-inf")


def _apply_constraints(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
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


def _top_p(logits: torch.Tensor, top_p: torch.Tensor, candidates: int = TOP_P_CANDIDATES,
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


def _filter(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
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
        logits = _top_p(logits, torch.tensor(ps, device=dev, dtype=logits.dtype).unsqueeze(1))
    mins = [r.params.min_p for r in rows]
    if any(mins):
        probs = logits.softmax(dim=1)
        min_p = torch.tensor(mins, device=dev, dtype=probs.dtype).unsqueeze(1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=1, keepdim=True).values, float("-inf"))
    return logits


def _draw(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """One token per row of `probs` [N, vocab], drawn from that row's distribution by
    inverting its CDF at one uniform number, taken from the row's own generator.

    One random number per row, not one per vocabulary entry: the exponential race
    argmax(p / E), E ~ Exp(1) (and torch.multinomial, which draws the same way) spends ~2 ms
    per row on a CPU drawing 151,936 exponentials, 64 ms at batch 32; the CDF (a cumulative
    sum, accumulated in float64 by PyTorch on CPU) takes ~0.06 ms a row."""
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=r.generator, device=cdf.device) for r in rows])
    target = (u * cdf[:, -1]).unsqueeze(1)
    # The first token whose cumulative mass exceeds the target: tokens of zero probability
    # (filtered out) add no mass, so they are never chosen.
    return torch.searchsorted(cdf, target, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)


def sample(logits: torch.Tensor, rows: list[SamplingRow], masks: StepMasks | None = None) -> SamplerOutput:
    """logits: [N, vocab] float32, one row per entry of `rows`.  `masks`: the grammar rows'
    bitmask, started before the forward (`StepMasks.start`); filled here when None."""
    raw = logits  # logprobs are the raw logits' (every change below works on a copy)

    if any(r.params.repetition_penalty != 1.0 or r.params.presence_penalty or r.params.frequency_penalty for r in rows):
        logits = logits.clone()
        _apply_penalties(logits, rows)
    if any(len(r.output_token_ids) < r.params.min_tokens for r in rows):
        logits = logits.clone()
        _apply_min_tokens(logits, rows)
    if any(r.params.constrains_logits for r in rows):
        logits = logits.clone()
        _apply_constraints(logits, rows)
    if any(r.grammar is not None for r in rows):
        logits = apply_grammar_masks(logits.clone(), [r.grammar for r in rows], masks)

    sampled_rows = [i for i, r in enumerate(rows) if not r.params.greedy]
    if len(sampled_rows) < len(rows):
        tokens = cpu_kernels.argmax_rows(logits)  # greedy rows keep this
    else:  # every row samples: no pass over the logits for an argmax nobody keeps
        tokens = torch.empty(len(rows), dtype=torch.long, device=logits.device)
    if sampled_rows:
        idx = torch.tensor(sampled_rows, device=logits.device)
        sub_rows = [rows[i] for i in sampled_rows]
        every = len(sampled_rows) == len(rows)  # then no copy of the rows is needed
        probs = _filter(logits if every else logits[idx], sub_rows).softmax(dim=-1)
        tokens[idx] = _draw(probs, sub_rows)

    lp_out: list = [None] * len(rows)
    asked = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    if asked:
        idx = torch.tensor(asked, device=raw.device)
        found = logprob_rows(raw if len(asked) == len(rows) else raw[idx], tokens[idx],
                             max(rows[i].params.logprobs for i in asked))
        for j, i in enumerate(asked):
            lp, rank, top = found.row(j)
            lp_out[i] = (lp, rank, top[: rows[i].params.logprobs])
    return SamplerOutput(token_ids=tokens.tolist(), logprobs=lp_out)
