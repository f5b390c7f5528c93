"""Paged attention: each new token attends to its own request's whole KV history.

The seed's decode step: "用 Q 去和 KV Cache（token1~7）的 K/V 做 attention".  Here the
KV history of every request lives in fixed-size blocks of one big preallocated tensor
per layer:

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]   (same for v)

A step's tokens arrive flattened across requests (varlen, no padding): decodes first
(one token each), then prefill chunks.  For each layer:

  1. the step's new K/V are scattered into the cache through `slot_mapping`
     (slot = block_id * block_size + offset);
  2. decodes: one batched attention of D single-token queries, each over the blocks in
     its block table, masked to its context length — O(context) per decoded token (on
     CPUs, our kernel reads the blocks in place: kernels/cpu_attention.cpp);
  3. prefill chunks: one batched causal attention over their (padded) query chunks and
     their block tables.

Two attention calls per layer at most, never a Python loop over requests.  Masks and
gather indices are built once per step by the model runner (`AttentionMetadata`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes (flat slot index)
    num_decode: int  # the first num_decode tokens are single-token decodes
    # decodes: one row per decode token
    decode_block_tables: torch.Tensor | None  # [D, max_blocks] long
    decode_mask: torch.Tensor | None  # [D, 1, 1, max_blocks*block_size] bool (True = attend)
    decode_context_lens: torch.Tensor | None  # [D] long: tokens each decode attends to (itself included)
    # prefills: one row per request with a prefill chunk
    prefill_block_tables: torch.Tensor | None  # [P, max_blocks] long
    prefill_mask: torch.Tensor | None  # [P, 1, max_q, max_blocks*block_size] bool
    prefill_gather: torch.Tensor | None  # [P, max_q] long: flat token index of each padded query row
    prefill_scatter: torch.Tensor | None  # [Tp] long: padded row (p*max_q+i) of each prefill token
    # our paged decode kernel (kernels/cpu.py `decode_attention_op`), or None: SDPA over a
    # gathered copy, masked by decode_mask
    decode_op: Callable | None = None

    @property
    def has_prefill(self) -> bool:
        return self.prefill_block_tables is not None


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hk, D] x [B, nb] -> [B, Hk, nb*bs, D] (each block read once)."""
    b, nb = block_tables.shape
    kv = cache[block_tables]  # [B, nb, bs, Hk, D]
    return kv.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor | None,  # [T, Hk, D]; None: already written (tokenloom_cpu::rope_write_kv)
    v: torch.Tensor | None,  # [T, Hk, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend. Returns [T, Hq, D]."""
    if k is not None:
        flat_k = k_cache.view(-1, k_cache.shape[2], k_cache.shape[3])
        flat_v = v_cache.view(-1, v_cache.shape[2], v_cache.shape[3])
        flat_k.index_copy_(0, meta.slot_mapping, k)
        flat_v.index_copy_(0, meta.slot_mapping, v)

    nd = meta.num_decode
    od = None  # the decodes' output, [nd, Hq, Dh]
    if nd and meta.decode_op is not None:
        # CPU: our kernel reads each block in place, once (kernels/cpu_attention.cpp).
        od = meta.decode_op(q[:nd], k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)
    elif nd:
        # Grouped-query attention with one query per request: the G query heads that share
        # a KV head become G query *rows* of that head ([D, Hk, G, Dh]), so each KV head is
        # read once for its whole group and nothing is expanded to Hq heads.  Query head h
        # uses KV head h // G (HF's repeat_interleave), which is exactly this view.
        hk = k_cache.shape[2]
        qd = q[:nd].view(nd, hk, q.shape[1] // hk, q.shape[2])
        kd = _gather_kv(k_cache, meta.decode_block_tables)
        vd = _gather_kv(v_cache, meta.decode_block_tables)
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
        od = od.reshape(nd, q.shape[1], q.shape[2])
    if not meta.has_prefill:  # a decode-only step: the decodes' output is the whole answer, no copy
        return od if od is not None else torch.empty_like(q)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = od
    qp = q[meta.prefill_gather].transpose(1, 2)  # [P, Hq, max_q, Dh]
    kp = _gather_kv(k_cache, meta.prefill_block_tables)
    vp = _gather_kv(v_cache, meta.prefill_block_tables)
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.prefill_mask, scale=scale, enable_gqa=True)
    op = op.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])  # [P*max_q, Hq, Dh]
    out[nd:] = op[meta.prefill_scatter]
    return out
