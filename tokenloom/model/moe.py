"""Mixture of experts: a router sends each token to k of a layer's E expert MLPs
(Mixtral, Qwen3-MoE, Qwen2-MoE).

A sparse layer's MLP is E SwiGLU experts and a router, a linear map from the hidden state
to E logits.  Per token: softmax over the logits (in float32), the k largest
probabilities, renormalised to sum to one where the family does it (Mixtral always, the
Qwen families where `norm_topk_prob`), and the output is sum_j w_j * expert_{e_j}(h).
Qwen2-MoE adds a shared expert that every token runs, scaled by sigmoid of its own
one-wide gate.

What that costs a decode step: a token reads k experts' weights, not E, and a step of B
tokens reads the union of the experts its tokens chose.  So `MoEStep` runs the step
grouped by expert: the step's (token, choice) pairs sorted by expert, each used expert's
rows gathered and multiplied by its gate_up and down matrices once -- one pass over that
expert's weights, through whichever linear the backend plan packed them for (our panel
GEMMs in fp32/bf16, our int8/int4 kernels, oneDNN, or nn.Linear on other devices) --
scaled by their routing weights and added back into their tokens' rows.  The Python work
of a step is per used expert, never per token.

Each expert is a `GatedMLP`, so loading, tensor-parallel sharding, packing and
quantization treat its two linears as they treat a dense layer's.  The router and the
shared expert's gate are `RouterLinear`s: packed for the same kernels as every matrix
(PyTorch's own bf16 product of one row by a router is 4x slower than ours:
docs/models.md), but never quantized -- they are a sliver of the bytes and
decide which bytes are read at all.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from tokenloom.model.layers import GatedMLP, Linear, bound_linear
from tokenloom.model.ops import Ops


class RouterLinear(nn.Linear):
    """The router (`gate` in checkpoints) and Qwen2-MoE's `shared_expert_gate`: a linear
    without bias that weight-only quantization leaves in the model's dtype
    (`keep_precision`, model/weights/quantization.py)."""

    keep_precision = True

    def __init__(self, hidden: int, out: int):
        super().__init__(hidden, out, bias=False)


class SparseMoE(nn.Module):
    """A sparse layer's MLP: the router, E experts, and Qwen2-MoE's shared expert and its
    gate.  Runs as the `MoEStep` that `bind` makes of it."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, intermediate: int, shared_intermediate: int,
                 renormalize: bool, weights_fp32: bool):
        super().__init__()
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.weights_fp32 = renormalize, weights_fp32
        self.gate = RouterLinear(hidden, num_experts)
        self.experts = nn.ModuleList(GatedMLP(hidden, intermediate, False) for _ in range(num_experts))
        self.shared_expert = GatedMLP(hidden, shared_intermediate, False) if shared_intermediate else None
        self.shared_expert_gate = RouterLinear(hidden, 1) if shared_intermediate else None
        # Tensor parallel: each rank holds a slice of every expert's intermediate dimension,
        # so its output is a partial sum; this sums the ranks' (model/weights/parallel.py).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def bind(self, ops: Ops, flat: bool) -> "MoEStep":
        shared = None if self.shared_expert is None else self.shared_expert.bind(ops, flat)
        shared_gate = None if self.shared_expert_gate is None else bound_linear(self.shared_expert_gate, flat)
        experts = [e.bind(ops, flat) for e in self.experts]
        return MoEStep(bound_linear(self.gate, flat), experts, self.top_k, self.renormalize, self.weights_fp32,
                       shared, shared_gate, self.reduce)


def route(logits: torch.Tensor, top_k: int, renormalize: bool,
          weights_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `weights_dtype`, expert ids [T, k]) of router logits [T, E]:
    softmax in float32, the k largest, renormalised where the family does it."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class MoEStep:
    """A sparse layer's MLP bound for running: h [T, hidden] -> its output [T, hidden].

    `weights_fp32`: the routing weights scale the experts' outputs in float32, rounded to
    the model's dtype once per (token, expert) (Mixtral), rather than being rounded to the
    model's dtype first (Qwen), as each family's reference computes it."""

    __slots__ = ("router", "experts", "top_k", "renormalize", "weights_fp32", "shared", "shared_gate", "reduce",
                 "record")

    def __init__(self, router: Linear, experts: list[Linear], top_k: int, renormalize: bool,
                 weights_fp32: bool, shared: Linear | None, shared_gate: Linear | None,
                 reduce: Callable[[torch.Tensor], torch.Tensor] | None):
        self.router, self.experts, self.top_k = router, experts, top_k
        self.renormalize, self.weights_fp32 = renormalize, weights_fp32
        self.shared, self.shared_gate, self.reduce = shared, shared_gate, reduce
        # Where a list: each step appends how many experts it ran (scripts/bench_moe.py).
        self.record: list[int] | None = None

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        logits = self.router(h)
        weights, ids = route(logits, self.top_k, self.renormalize,
                             torch.float32 if self.weights_fp32 else h.dtype)
        out = self._one_token(h, weights, ids) if h.shape[0] == 1 else self._grouped(h, weights, ids)
        if self.shared is not None:
            out = out + torch.sigmoid(self.shared_gate(h)) * self.shared(h)
        if self.reduce is not None:
            out = self.reduce(out)
        return out

    def _one_token(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """One row (a batch-1 decode step): its k experts on it, weighted in one product."""
        experts = self.experts
        chosen = ids[0].tolist()
        if self.record is not None:
            self.record.append(len(chosen))
        ys = torch.cat([experts[e](h) for e in chosen])  # [k, hidden]
        if self.weights_fp32:
            return torch.mm(weights, ys.float()).to(h.dtype)
        return torch.mm(weights, ys)

    def _grouped(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Many rows: the (token, choice) pairs sorted by expert, each used expert run once
        over the rows that chose it, the results weighted and added back per token."""
        k = ids.shape[1]
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=len(self.experts)).tolist()  # the step's one host sync
        rows = order // k  # the token of each pair, in expert order
        xs = h.index_select(0, rows)
        experts, ys, start = self.experts, [], 0
        for e, n in enumerate(counts):
            if n:
                ys.append(experts[e](xs[start: start + n]))
                start += n
        if self.record is not None:
            self.record.append(len(ys))
        y = torch.cat(ys) * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros_like(h).index_add_(0, rows, y.to(h.dtype))
