"""Paged attention: each new token attends to its own request's whole KV history.

The seed's decode step: "用 Q 去和 KV Cache（token1~7）的 K/V 做 attention".  Here the
KV history of every request lives in fixed-size blocks of one big preallocated tensor
per layer:

    k_cache[layer]: [num_blocks, block_size, num_kv_heads, head_dim]   (same for v)

A step's tokens arrive flattened across requests (varlen, no padding): decodes first
(one token each), then prefill chunks.  For each layer:

  1. the step's new K/V are written into the cache through `slot_mapping`
     (slot = block_id * block_size + offset; -1 = a padded row, written nowhere);
  2. decodes: each single-token query over the blocks in its block table, up to its
     context length — O(context) per decoded token;
  3. prefill chunks: causal attention over their cached prefix and themselves.

How steps 1-3 run is the *attention backend*, chosen once when the runner starts
(`--attention-backend`):

  triton  our Triton kernels read the blocks in place (kernels/triton/): split-KV decode,
          varlen paged prefill, a KV write that skips padded slots; the GPU default, and
          the only backend CUDA graphs capture (no host sync, no data-dependent shapes);
  cpu     our C++ decode kernel reads the blocks in place (kernels/cpu_attention.cpp);
          prefill chunks through SDPA over gathered blocks; the CPU default;
  sdpa    PyTorch's SDPA over a gathered copy of the blocks with a mask: the reference
          every other backend is tested against.

Layers may differ in how they attend (`LayerAttention`): a sliding window (Mistral on every
layer, Gemma on alternate ones, Qwen2 on the upper ones) and a soft-cap on the scores
(Gemma 2: cap * tanh(s / cap)).  A backend is built for the model's few distinct kinds and
gives each its own path, chosen once when it is built: a kind its kernels cannot run
(soft-capping anywhere but the reference; a window in the CPU decode kernel) goes through the
reference, SDPA over gathered blocks with masks, or its explicit-math twin where scores are
capped (`_capped_attention`, transformers' eager order).

Two attention calls per layer at most, never a Python loop over requests.  Lengths and
block tables are gathered once per step by the model runner; each backend turns them into
its own `AttentionMetadata` (`AttentionBackend.metadata`: SDPA's masks and gather indices,
Triton's split count), so the runner knows no backend's details.  Which backend runs is
decided once, in model/backends.py; `build_backend` only builds it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention adds to plain causal attention: a sliding window (the
    tokens it looks back over, itself included) and a soft-cap on its scores."""

    window: int | None = None
    softcap: float | None = None


def attention_kinds(per_layer: Sequence[LayerAttention]) -> tuple[tuple[LayerAttention, ...], tuple[int, ...]]:
    """The distinct kinds among a model's layers (in order of first use) and each layer's index into them."""
    kinds = tuple(dict.fromkeys(per_layer))
    return kinds, tuple(kinds.index(k) for k in per_layer)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes (flat slot index; -1: nowhere)
    num_decode: int  # the first num_decode tokens are single-token decodes
    backend: "AttentionBackend"
    # decodes: one row per decode token
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_context_lens: torch.Tensor | None  # [D]: tokens each decode attends to (itself included); 0 = padding
    # [D, 1, 1, max_blocks*block_size] bool (True = attend), per window (None: full attention), for the
    # kinds that decode through the reference
    decode_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    decode_num_splits: int = 1  # triton: context slices per decode (split-KV)
    # prefills: one row per request with a prefill chunk
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks]
    prefill_q_starts: torch.Tensor | None = None  # [P] first row of each chunk in the step
    prefill_q_lens: torch.Tensor | None = None  # [P] rows of each chunk
    prefill_ctx_lens: torch.Tensor | None = None  # [P] tokens cached before each chunk
    prefill_max_q: int = 0
    # every prefill chunk starts its request (nothing cached before it): plain causal attention
    # then needs no mask (`_sdpa_prefill`: SDPA's own causal path, which skips the masked blocks)
    prefill_from_zero: bool = False
    # [P, 1, max_q, max_blocks*block_size] bool, per window, for the kinds that prefill through the
    # reference (but plain causal ones when prefill_from_zero)
    prefill_masks: dict[int | None, torch.Tensor] = field(default_factory=dict)
    prefill_gather: torch.Tensor | None = None  # [P, max_q] long: flat token index of each padded query row
    prefill_scatter: torch.Tensor | None = None  # [Tp] long: padded row (p*max_q+i) of each prefill token
    # the chunks are max_q rows each, one after another: the padded layout is a view of the rows
    # (one long prompt, or equal ones), gathered and scattered by nobody
    prefill_dense: bool = False
    # prefill_from_zero with chunks of unequal lengths: the chunks in groups of near-equal length,
    # each padded only to its own longest (`_causal_groups`), and the order that puts the groups'
    # rows back in token order
    prefill_groups: list["PrefillGroup"] = field(default_factory=list)
    prefill_group_order: torch.Tensor | None = None  # [Tp] long

    @property
    def has_prefill(self) -> bool:
        return self.prefill_block_tables is not None


@dataclass
class PrefillGroup:
    """Prefill chunks attended in one padded SDPA call: their padded query rows and block tables."""
    gather: torch.Tensor  # [n, max_q] long: flat token index of each padded query row
    block_tables: torch.Tensor  # [n, blocks covering max_q]
    max_q: int


# Padding a chunk of L rows to a group's longest, Lmax, costs attention work ~ Lmax^2 - L^2;
# a call of its own costs a few small ops per layer.  Below this many rows^2 of padding (a
# 64-row chunk beside a 90-row one), or a quarter of Lmax^2 (so that many distinct long
# lengths make a few calls, not one each), a chunk joins the longer one's call.
GROUP_PADDING = 4096


def _causal_groups(lens: list[int]) -> list[list[int]]:
    """Chunk indices in groups for `_sdpa_prefill`'s causal path: longest first, each chunk in
    the current group while its padding to the group's longest stays under GROUP_PADDING or
    a quarter of the longest's rows^2.
    Padding every chunk of a step to the longest one made attention about half of a prefill
    step's time outside the GEMMs (docs/performance.md, "Prefill attention in length groups")."""
    groups: list[list[int]] = []
    longest = 0
    for i in sorted(range(len(lens)), key=lambda i: -lens[i]):
        if groups and longest * longest - lens[i] * lens[i] <= max(GROUP_PADDING, longest * longest // 4):
            groups[-1].append(i)
        else:
            groups.append([i])
            longest = lens[i]
    return groups


def _take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x[idx] for an integer index over x's first dimension: whole rows copied by
    index_select, where CPU advanced indexing copies element by element (~3x slower for a
    prefill's [2048, 14, 64] rows)."""
    return x.index_select(0, idx.reshape(-1)).view(*idx.shape, *x.shape[1:])


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hk, D] x [B, nb] -> [B, Hk, nb*bs, D] (each block read once)."""
    b, nb = block_tables.shape
    kv = _take(cache, block_tables)  # [B, nb, bs, Hk, D]
    return kv.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _capped_attention(q, k, v, mask, scale: float, cap: float) -> torch.Tensor:
    """softmax(cap * tanh(q k^T * scale / cap), masked) v in transformers' eager order and
    roundings (scores in q's dtype, the softmax in float32): SDPA has no soft-cap."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    s = torch.tanh(s / cap) * cap
    s = s.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype), v)


def _sdpa_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kind: LayerAttention) -> torch.Tensor:
    """Grouped-query attention with one query per request: the G query heads that share a
    KV head become G query *rows* of that head ([D, Hk, G, Dh]), so each KV head is read
    once for its whole group and nothing is expanded to Hq heads.  Query head h uses KV
    head h // G (HF's repeat_interleave), which is exactly this view."""
    nd = q.shape[0]
    hk = k_cache.shape[2]
    qd = q.view(nd, hk, q.shape[1] // hk, q.shape[2])
    kd = _gather_kv(k_cache, meta.decode_block_tables)
    vd = _gather_kv(v_cache, meta.decode_block_tables)
    mask = meta.decode_masks[kind.window]
    if kind.softcap is None:
        od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    else:
        od = _capped_attention(qd, kd, vd, mask, scale, kind.softcap)
    return od.reshape(nd, q.shape[1], q.shape[2])


def _causal_from_zero(meta: AttentionMetadata, kind: LayerAttention) -> bool:
    """Whether `kind`'s prefill is plain causal attention from each request's first token."""
    return meta.prefill_from_zero and kind.window is None and kind.softcap is None


def _prefill_queries(q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The prefill rows of q [T, Hq, D] as padded chunks [P, Hq, max_q, D]."""
    if meta.prefill_dense:
        p, n = meta.prefill_block_tables.shape[0], meta.prefill_max_q
        return q[meta.num_decode:meta.num_decode + p * n].view(p, n, q.shape[1], q.shape[2]).transpose(1, 2)
    return _take(q, meta.prefill_gather).transpose(1, 2)


def _prefill_rows(op: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """Padded chunks' outputs [P, Hq, max_q, D] back as the prefill rows [Tp, Hq, D]."""
    rows = op.transpose(1, 2).reshape(-1, op.shape[1], op.shape[3])
    return rows if meta.prefill_dense else _take(rows, meta.prefill_scatter)


def _causal_chunks(qp, k_cache, v_cache, block_tables, n: int, scale: float) -> torch.Tensor:
    """Causal attention of padded chunks qp [P, Hq, n, Dh] that start their requests, over the
    first n keys of their blocks: [P, Hq, n, Dh]."""
    tables = block_tables[:, :(n + k_cache.shape[1] - 1) // k_cache.shape[1]]
    kp, vp = _gather_kv(k_cache, tables)[:, :, :n], _gather_kv(v_cache, tables)[:, :, :n]
    return F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=True)


def _causal_prefill_groups(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """`_causal_chunks` per length group (`_causal_groups`), the rows back in token order."""
    rows = []
    for g in meta.prefill_groups:
        out = _causal_chunks(_take(q, g.gather).transpose(1, 2), k_cache, v_cache, g.block_tables, g.max_q, scale)
        rows.append(out.transpose(1, 2).reshape(-1, out.shape[1], out.shape[3]))
    return _take(torch.cat(rows), meta.prefill_group_order)


def _sdpa_prefill(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kind: LayerAttention) -> torch.Tensor:
    """The prefill rows' output [Tp, Hq, D], through SDPA over gathered blocks."""
    if meta.prefill_groups and _causal_from_zero(meta, kind):
        return _causal_prefill_groups(q, k_cache, v_cache, meta, scale)
    qp = _prefill_queries(q, meta)  # [P, Hq, max_q, Dh]
    if _causal_from_zero(meta, kind):
        # Query row i of a chunk is the request's token i and sees its keys 0..i: SDPA's causal
        # (top-left) mask over the first max_q keys, no mask built or read, the blocks above the
        # diagonal skipped.  A padded row sees keys past its request's end; it is dropped below.
        return _prefill_rows(_causal_chunks(qp, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_max_q,
                                            scale), meta)
    kp = _gather_kv(k_cache, meta.prefill_block_tables)
    vp = _gather_kv(v_cache, meta.prefill_block_tables)
    mask = meta.prefill_masks[kind.window]
    if kind.softcap is None:
        op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale, enable_gqa=True)
    else:  # the G query heads of each KV head as one group: [P, Hk, G, max_q, Dh] against [P, Hk, 1, L, Dh]
        p, hq, mq, d = qp.shape
        hk = kp.shape[1]
        op = _capped_attention(qp.reshape(p, hk, hq // hk, mq, d), kp.unsqueeze(2), vp.unsqueeze(2),
                               mask.unsqueeze(1), scale, kind.softcap).reshape(p, hq, mq, d)
    return _prefill_rows(op, meta)


def _to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if x is None else x.to(device, non_blocking=True)


# Which backends cap attention scores themselves; the others run soft-capped layers through
# the reference (model/backends.py reports it in the plan and keeps CUDA graphs off then).
SOFTCAP_NATIVE = {"sdpa": True, "cpu": False, "triton": False}


class AttentionBackend:
    """How a layer writes its K/V and attends.  The reference: SDPA over gathered blocks
    (explicit math where scores are soft-capped), masked per window."""

    name = "sdpa"
    graphable = False  # decode steps can be captured in a CUDA graph

    def __init__(self, kinds: Sequence[LayerAttention] | None = None):
        self.kinds = tuple(kinds or (LayerAttention(),))
        # the windows whose masks `metadata` builds: those of the kinds that run the reference
        self.decode_mask_windows = {k.window for k in self.kinds if self.decodes_by_reference(k)}
        self.prefill_mask_windows = {k.window for k in self.kinds if self.prefills_by_reference(k)}

    def decodes_by_reference(self, kind: LayerAttention) -> bool:
        """Whether `kind`'s decodes run the reference (SDPA / capped math over gathered blocks)."""
        return True

    def prefills_by_reference(self, kind: LayerAttention) -> bool:
        return True

    def metadata(self, slot_mapping: torch.Tensor, device: torch.device, block_size: int, *,
                 decode_block_tables: torch.Tensor | None = None, decode_context_lens: torch.Tensor | None = None,
                 prefill_block_tables: torch.Tensor | None = None, prefill_q_starts: torch.Tensor | None = None,
                 prefill_q_lens: torch.Tensor | None = None,
                 prefill_ctx_lens: torch.Tensor | None = None) -> AttentionMetadata:
        """A step's metadata on `device` from host tensors: slots [T]; per decode row its
        block table (padded with block 0) and context length; per prefill chunk its block
        table, first row, row count and cached prefix.  Adds what this backend reads besides."""
        num_decode = 0 if decode_block_tables is None else decode_block_tables.shape[0]
        meta = AttentionMetadata(slot_mapping=_to(slot_mapping, device), num_decode=num_decode, backend=self,
                                 decode_block_tables=_to(decode_block_tables, device),
                                 decode_context_lens=_to(decode_context_lens, device))
        if num_decode and self.decode_mask_windows:
            ctx, length = decode_context_lens, decode_block_tables.shape[1] * block_size
            j = torch.arange(length).unsqueeze(0)
            causal = j < ctx.unsqueeze(1)
            for window in self.decode_mask_windows:
                mask = causal if window is None else causal & (j >= (ctx - window).unsqueeze(1))
                meta.decode_masks[window] = _to(mask.view(num_decode, 1, 1, length), device)
        if prefill_block_tables is not None:
            cs, ns, offs = prefill_ctx_lens, prefill_q_lens, prefill_q_starts
            max_q = int(ns.max())
            meta.prefill_block_tables, meta.prefill_max_q = _to(prefill_block_tables, device), max_q
            meta.prefill_q_starts, meta.prefill_q_lens = _to(offs, device), _to(ns, device)
            meta.prefill_ctx_lens = _to(cs, device)
            meta.prefill_from_zero = bool((cs == 0).all())
            if self.prefill_mask_windows:
                length = prefill_block_tables.shape[1] * block_size
                ar = torch.arange(max_q).unsqueeze(0)
                row = torch.minimum(ar, (ns - 1).unsqueeze(1))  # padded rows repeat the last real query
                qpos = (cs.unsqueeze(1) + row).unsqueeze(2)
                j = torch.arange(length).view(1, 1, length)
                causal = j <= qpos
                for window in {k.window for k in self.kinds
                               if self.prefills_by_reference(k) and not _causal_from_zero(meta, k)}:
                    mask = causal if window is None else causal & (j > qpos - window)
                    meta.prefill_masks[window] = _to(mask.unsqueeze(1), device)
                gather = offs.unsqueeze(1) + row
                valid = ar < ns.unsqueeze(1)
                p = prefill_block_tables.shape[0]
                meta.prefill_dense = torch.equal(gather.flatten(), torch.arange(num_decode, num_decode + p * max_q))
                meta.prefill_gather = _to(gather, device)
                meta.prefill_scatter = _to(torch.arange(p * max_q).view(p, max_q)[valid], device)
                if meta.prefill_from_zero and not meta.prefill_dense:
                    self._group_chunks(meta, gather, prefill_block_tables, ns.tolist(), block_size, device)
        return meta

    @staticmethod
    def _group_chunks(meta: AttentionMetadata, gather: torch.Tensor, block_tables: torch.Tensor, lens: list[int],
                      block_size: int, device: torch.device) -> None:
        """`meta.prefill_groups` and the order that puts their rows back, where the chunks fall
        in more than one length group."""
        groups = _causal_groups(lens)
        if len(groups) < 2:
            return
        starts = [0] * len(lens)  # each chunk's first row in the groups' concatenated rows
        at = 0
        for g in groups:
            n = lens[g[0]]  # the group's longest comes first
            for j, c in enumerate(g):
                starts[c] = at + j * n
            at += len(g) * n
            idx, blocks = torch.tensor(g), (n + block_size - 1) // block_size
            meta.prefill_groups.append(PrefillGroup(gather=_to(gather[idx, :n], device),
                                                    block_tables=_to(block_tables[idx, :blocks], device), max_q=n))
        order = torch.cat([torch.arange(starts[c], starts[c] + lens[c]) for c in range(len(lens))])
        meta.prefill_group_order = _to(order, device)

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor) -> AttentionMetadata:
        """A decode-only step's metadata over tensors already on the device (the persistent
        buffers CUDA graphs replay: runner/cuda_graphs.py); no host work, no masks."""
        return AttentionMetadata(slot_mapping=slot_mapping, num_decode=block_tables.shape[0], backend=self,
                                 decode_block_tables=block_tables, decode_context_lens=context_lens)

    def attend(self, meta: AttentionMetadata) -> tuple[Callable, ...]:
        """This step's attention for each kind (`self.kinds`), as every layer of that kind
        calls it: (q, k_cache, v_cache, scale) -> [T, Hq, D], the step's K/V already written.
        Made once per step, so a layer runs no checks."""
        return tuple(self._attend(meta, kind) for kind in self.kinds)

    def _attend(self, meta: AttentionMetadata, kind: LayerAttention) -> Callable:
        def attend(q, k_cache, v_cache, scale):
            return paged_attention(q, None, None, k_cache, v_cache, meta, scale, kind)

        return attend

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, kind: LayerAttention) -> torch.Tensor:
        return _sdpa_decode(q, k_cache, v_cache, meta, scale, kind)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor,
                kind: LayerAttention) -> None:
        out[meta.num_decode:] = _sdpa_prefill(q, k_cache, v_cache, meta, scale, kind)


class CpuAttention(AttentionBackend):
    """Decodes through our C++ kernel, which reads each block in place once; prefills (and
    the decodes of windowed or soft-capped layers, which the kernel has not) through the
    reference's masks."""

    name = "cpu"

    def __init__(self, decode_op: Callable, kinds: Sequence[LayerAttention] | None = None,
                 prefill_op: Callable | None = None):
        self.decode_op = decode_op  # (q, k_cache, v_cache, block_tables, context_lens, scale) -> out
        # (q, k_cache, v_cache, block_tables, starts, lens, row0, scale) -> the prefill rows: plain
        # causal prefills from each request's first token (kernels/amx.py), or None
        self.prefill_op = prefill_op
        super().__init__(kinds)

    def decodes_by_reference(self, kind):
        return kind.window is not None or kind.softcap is not None

    def _attend(self, meta, kind):
        if meta.has_prefill or not meta.num_decode or self.decodes_by_reference(kind):
            return super()._attend(meta, kind)
        # decode rows only: straight to the kernel, nothing between a layer and it
        op, tables, lens = self.decode_op, meta.decode_block_tables, meta.decode_context_lens

        def attend_decodes(q, k_cache, v_cache, scale):
            return op(q, k_cache, v_cache, tables, lens, scale)

        return attend_decodes

    def decode(self, q, k_cache, v_cache, meta, scale, kind):
        if self.decodes_by_reference(kind):
            return _sdpa_decode(q, k_cache, v_cache, meta, scale, kind)
        return self.decode_op(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)

    def prefill(self, q, k_cache, v_cache, meta, scale, out, kind):
        if (self.prefill_op is not None and _causal_from_zero(meta, kind) and q.dtype == torch.bfloat16
                and k_cache.shape[1] % 16 == 0):
            out[meta.num_decode:] = self.prefill_op(q, k_cache, v_cache, meta.prefill_block_tables,
                                                    meta.prefill_q_starts, meta.prefill_q_lens, meta.num_decode, scale)
        else:
            super().prefill(q, k_cache, v_cache, meta, scale, out, kind)


class TritonAttention(AttentionBackend):
    """Our Triton kernels (kernels/triton/paged_attention.py): nothing gathered, no masks,
    no host synchronisation -- for every kind but soft-capped ones, which run the reference."""

    name = "triton"

    def __init__(self, kinds: Sequence[LayerAttention] | None, num_kv_heads: int, device: torch.device):
        from tokenloom.kernels.triton import decode_num_splits, fused, paged_attention

        super().__init__(kinds)
        self.graphable = not self.decode_mask_windows  # the reference's masks are host work
        self._fused, self._pa = fused, paged_attention
        # split-KV decode sizes its splits to the SMs; on CPUs (Triton's interpreter, in tests)
        # a pretend 4, so the splits and their merge are exercised there too
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self._num_splits = lambda b: decode_num_splits(b, num_kv_heads, num_sms)

    def decodes_by_reference(self, kind):
        return kind.softcap is not None

    def prefills_by_reference(self, kind):
        return kind.softcap is not None

    def metadata(self, slot_mapping, device, block_size, **tensors):
        meta = super().metadata(slot_mapping, device, block_size, **tensors)
        meta.decode_num_splits = self._num_splits(meta.num_decode)
        return meta

    def decode_metadata(self, slot_mapping, block_tables, context_lens):
        meta = super().decode_metadata(slot_mapping, block_tables, context_lens)
        meta.decode_num_splits = self._num_splits(meta.num_decode)
        return meta

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping):
        self._fused.write_kv(k, v, k_cache, v_cache, slot_mapping)

    def decode(self, q, k_cache, v_cache, meta, scale, kind):
        if kind.softcap is not None:
            return _sdpa_decode(q, k_cache, v_cache, meta, scale, kind)
        return self._pa.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                     num_splits=meta.decode_num_splits, window=kind.window)

    def prefill(self, q, k_cache, v_cache, meta, scale, out, kind):
        if kind.softcap is not None:
            return super().prefill(q, k_cache, v_cache, meta, scale, out, kind)
        self._pa.paged_prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_q_starts,
                               meta.prefill_q_lens, meta.prefill_ctx_lens, meta.prefill_max_q, scale, out,
                               window=kind.window)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor | None,  # [T, Hk, D]; None: already written (a fused rotary + KV write op)
    v: torch.Tensor | None,  # [T, Hk, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kind: LayerAttention = LayerAttention(),
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend. Returns [T, Hq, D]."""
    backend = meta.backend
    if k is not None:
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode
    od = backend.decode(q[:nd], k_cache, v_cache, meta, scale, kind) if nd else None
    if not meta.has_prefill:  # a decode-only step: the decodes' output is the whole answer, no copy
        return od if od is not None else torch.empty_like(q)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = od
    backend.prefill(q, k_cache, v_cache, meta, scale, out, kind)
    return out


def build_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, num_kv_heads: int,
                  kinds: Sequence[LayerAttention] | None = None) -> AttentionBackend:
    """The attention backend `name` for layers of `kinds`, as the backend plan
    (model/backends.py) resolved it; nothing is chosen here."""
    if name == "triton":
        return TritonAttention(kinds, num_kv_heads, device)
    if name == "cpu":
        from tokenloom.kernels import amx as amx_kernels

        # our decode kernel for this CPU: AMX tiles for bf16 caches where they run, else AVX-512 / AVX2;
        # causal prefills on tiles there too
        return CpuAttention(amx_kernels.decode_attention_op(device, dtype, head_dim), kinds,
                            amx_kernels.prefill_attention_op(device, dtype, head_dim))
    return AttentionBackend(kinds)
