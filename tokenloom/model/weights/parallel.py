"""Tensor parallelism: each of N ranks holds 1/N of every layer and they sum as they go.

Split the way the math allows with the fewest exchanges (Megatron-style):

    qkv_proj    column-parallel: rank r computes its own query heads and the KV heads they
                read (GQA: KV heads split too, or replicated when there are fewer than ranks)
    attention   entirely local: each rank attends with its heads over its own KV cache shard
    o_proj      row-parallel: a partial sum of the output per rank -> one all-reduce
    gate_up     column-parallel (gate and up split alike, so SiLU(gate) * up stays local)
    down_proj   row-parallel -> one all-reduce
    experts     (a mixture-of-experts layer) each expert's gate_up and down split like a
                dense MLP's, the shared expert too; the router replicated, so every rank
                picks the same experts; the block's partial output -> one all-reduce
    embedding   vocabulary-parallel: rank r looks up the ids in its slice of the vocabulary,
                zeros elsewhere -> one all-reduce
    lm_head     vocabulary-parallel: each rank scores its slice -> one all-gather

so a layer costs two all-reduces.  `shard_model` cuts a loaded full model down to rank r's
shard in place (before any CPU weight packing, so our kernels run on each shard) and
returns the shard's ModelArgs (its head and intermediate counts; the vocabulary stays the
model's).  The collectives are torch.distributed's (gloo on CPUs, NCCL on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class TPGroup:
    """This process's place in the tensor-parallel group (the default process group)."""

    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; float32 on the wire where gloo lacks the dtype."""
        if x.dtype in (torch.float32, torch.float64) or x.device.type == "cuda":
            dist.all_reduce(x)
            return x
        wide = x.float()
        dist.all_reduce(wide)
        return x.copy_(wide)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` concatenated along the last dimension, in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)


class RowParallel(nn.Module):
    """A linear layer holding a slice of the input features: partial sums, then all-reduce."""

    def __init__(self, linear: nn.Module, tp: TPGroup):
        super().__init__()
        self.linear = linear
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(self.linear(x))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + n) of the embedding; ids outside give zeros; all-reduce."""

    def __init__(self, weight: torch.Tensor, start: int, num_real: int, tp: TPGroup):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.start, self.num_real, self.tp = start, num_real, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_real)
        out = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight)
        return self.tp.all_reduce(out * inside.unsqueeze(-1).to(out.dtype))


class VocabParallelHead(nn.Module):
    """The LM head over a slice of the vocabulary; the slices all-gathered into full logits
    (the padding past the real vocabulary cut off)."""

    def __init__(self, linear: nn.Module, vocab_size: int, tp: TPGroup):
        super().__init__()
        self.linear = linear
        self.vocab_size, self.tp = vocab_size, tp

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.linear(h))[..., : self.vocab_size]


def _rows(w: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([w[a:b] for a, b in spans], dim=0).clone()


def head_split(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[range, range]:
    """Rank r's query heads and the KV heads they read (query head h reads KV head h // G)."""
    if num_heads % tp.size:
        raise ValueError(f"--tensor-parallel-size {tp.size} must divide the {num_heads} attention heads")
    if num_kv_heads % tp.size and tp.size % num_kv_heads:
        raise ValueError(f"--tensor-parallel-size {tp.size} and the {num_kv_heads} KV heads: one must divide the "
                         f"other (KV heads are split, or replicated when there are fewer than ranks)")
    per = num_heads // tp.size
    q = range(tp.rank * per, (tp.rank + 1) * per)
    group = num_heads // num_kv_heads
    kv = range(q.start // group, (q.stop - 1) // group + 1)
    return q, kv


def check_split(num_heads: int, num_kv_heads: int, intermediate_size: int, size: int,
                moe_intermediate_size: int = 0, shared_expert_intermediate_size: int = 0) -> None:
    """Raise ValueError if a model of this shape cannot be split over `size` ranks."""
    head_split(num_heads, num_kv_heads, TPGroup(0, size))
    for key, width in (("intermediate_size", intermediate_size), ("moe_intermediate_size", moe_intermediate_size),
                       ("shared_expert_intermediate_size", shared_expert_intermediate_size)):
        if width % size:
            raise ValueError(f"--tensor-parallel-size {size} must divide {key} {width}")


def shard_model(model: nn.Module, a, tp: TPGroup):
    """Cut `model` (a loaded CausalLM, weights still plain) down to rank `tp.rank`'s shard.
    Returns the shard's ModelArgs."""
    check_split(a.num_heads, a.num_kv_heads, a.intermediate_size, tp.size, a.moe_intermediate_size,
                a.shared_expert_intermediate_size)
    q_heads, kv_heads = head_split(a.num_heads, a.num_kv_heads, tp)
    d = a.head_dim
    q_span = (q_heads.start * d, q_heads.stop * d)
    k0 = a.num_heads * d
    v0 = k0 + a.num_kv_heads * d
    kv_spans = [(k0 + kv_heads.start * d, k0 + kv_heads.stop * d), (v0 + kv_heads.start * d, v0 + kv_heads.stop * d)]
    with torch.no_grad():
        for layer in model.layers:
            att = layer.self_attn
            qkv = att.qkv_proj
            qkv.weight = nn.Parameter(_rows(qkv.weight, [q_span, *kv_spans]), requires_grad=False)
            if qkv.bias is not None:
                qkv.bias = nn.Parameter(_rows(qkv.bias, [q_span, *kv_spans]), requires_grad=False)
            att.num_heads, att.num_kv_heads = len(q_heads), len(kv_heads)
            att.q_size, att.kv_size = len(q_heads) * d, len(kv_heads) * d
            att.o_proj = RowParallel(_input_slice(att.o_proj, *q_span, tp), tp)
            mlp = layer.mlp
            if hasattr(mlp, "experts"):  # a mixture-of-experts block (model/moe.py): one all-reduce for all
                for expert in mlp.experts:
                    _shard_gated(expert, tp, reduce=False)
                if mlp.shared_expert is not None:
                    _shard_gated(mlp.shared_expert, tp, reduce=False)
                mlp.reduce = tp.all_reduce
            else:
                _shard_gated(mlp, tp, reduce=True)
        _shard_vocab(model, a, tp)
    return replace(a, num_heads=len(q_heads), num_kv_heads=len(kv_heads),
                   intermediate_size=a.intermediate_size // tp.size,
                   moe_intermediate_size=a.moe_intermediate_size // tp.size,
                   shared_expert_intermediate_size=a.shared_expert_intermediate_size // tp.size)


def _shard_gated(mlp: nn.Module, tp: TPGroup, reduce: bool) -> None:
    """Rank r's slice of a SwiGLU MLP's intermediate dimension: gate_up's rows of gate and up
    alike, down's columns; with `reduce`, down all-reduces its partial sums itself."""
    full = mlp.intermediate
    inter = full // tp.size
    lo, hi = tp.rank * inter, (tp.rank + 1) * inter
    gu = mlp.gate_up_proj
    spans = [(lo, hi), (full + lo, full + hi)]
    gu.weight = nn.Parameter(_rows(gu.weight, spans), requires_grad=False)
    if gu.bias is not None:
        gu.bias = nn.Parameter(_rows(gu.bias, spans), requires_grad=False)
    mlp.intermediate = inter
    down = _input_slice(mlp.down_proj, lo, hi, tp)
    mlp.down_proj = RowParallel(down, tp) if reduce else down


def _input_slice(linear: nn.Linear, lo: int, hi: int, tp: TPGroup) -> nn.Linear:
    """Columns [lo, hi) of a linear layer's weight; its bias on rank 0 only (added once)."""
    out = nn.Linear(hi - lo, linear.out_features, bias=linear.bias is not None and tp.rank == 0,
                    device=linear.weight.device, dtype=linear.weight.dtype)
    out.weight.copy_(linear.weight[:, lo:hi])
    if out.bias is not None:
        out.bias.copy_(linear.bias)
    return out.requires_grad_(False)


def _shard_vocab(model: nn.Module, a, tp: TPGroup) -> None:
    vocab = a.vocab_size
    per = -(-vocab // tp.size)
    lo, hi = tp.rank * per, min((tp.rank + 1) * per, vocab)
    full = model.embed_tokens.weight
    emb = torch.zeros(per, full.shape[1], dtype=full.dtype, device=full.device)
    emb[: hi - lo] = full[lo:hi]
    model.embed_tokens = VocabParallelEmbedding(emb, lo, hi - lo, tp)
    head_w = emb if model.lm_head is None else torch.zeros_like(emb)
    if model.lm_head is not None:
        head_w[: hi - lo] = model.lm_head.weight[lo:hi]
    head = nn.Linear(full.shape[1], per, bias=False, device=full.device, dtype=full.dtype).requires_grad_(False)
    head.weight = nn.Parameter(head_w, requires_grad=False)  # tied: the embedding's own slice
    model.lm_head = VocabParallelHead(head, vocab, tp)
