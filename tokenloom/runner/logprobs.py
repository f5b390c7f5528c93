"""What a request asks to see of a row of logits: a token's logprob, its rank, the top n.

The sampler reports them for each sampled token (`logprobs`), the model runner for each prompt
token (`prompt_logprobs`).  A logprob is the logit minus the row's log-sum-exp; the rank is 1 +
how many tokens have a larger logit; the top n are the n largest logits, largest first.  On
CPUs our kernel finds the rank and the top n in one pass over each row (kernels/cpu_sampling.cpp,
equal logits in index order), where a log-softmax, a comparison and a topk each took a pass of
their own (docs/performance.md, "Logprobs", has the timings); elsewhere PyTorch's ops do it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenloom.kernels import cpu as cpu_kernels


@dataclass
class LogprobRows:
    token: torch.Tensor  # [rows] the targets' logprobs
    rank: torch.Tensor  # [rows] int64
    top_ids: torch.Tensor  # [rows, n] int64
    top: torch.Tensor  # [rows, n] logprobs, largest first

    def row(self, i: int) -> tuple[float, int, list[tuple[int, float]]]:
        """(logprob, rank, [(token, logprob), ...]) of row i, as Python values."""
        return (self.token[i].item(), int(self.rank[i]),
                list(zip(self.top_ids[i].tolist(), self.top[i].tolist())))


def logprob_rows(logits: torch.Tensor, targets: torch.Tensor, n: int) -> LogprobRows:
    """`logits` [rows, vocab] (float32), `targets` [rows]: each row's target logprob and rank,
    and its n most likely tokens."""
    targets = targets.to(device=logits.device, dtype=torch.long)
    found = cpu_kernels.logprob_rows(logits, targets, n)
    if found is not None:
        ranks, ids, vals = found
        lse = torch.logsumexp(logits, dim=-1)
        token = logits.gather(1, targets.unsqueeze(1)).squeeze(1) - lse
        return LogprobRows(token, ranks, ids, vals - lse.unsqueeze(1))
    lps = logits.log_softmax(dim=-1)
    token = lps.gather(1, targets.unsqueeze(1)).squeeze(1)
    ranks = (lps > token.unsqueeze(1)).sum(dim=1) + 1
    vals, ids = lps.topk(n, dim=1)
    return LogprobRows(token, ranks, ids, vals)
