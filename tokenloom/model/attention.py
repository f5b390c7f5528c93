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

Two attention calls per layer at most, never a Python loop over requests.  Lengths and
block tables are gathered once per step by the model runner; each backend turns them into
its own `AttentionMetadata` (`AttentionBackend.metadata`: SDPA's masks and gather indices,
Triton's split count), so the runner knows no backend's details.  Which backend runs is
decided once, in model/backends.py; `build_backend` only builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] long: where each new token's K/V goes (flat slot index; -1: nowhere)
    num_decode: int  # the first num_decode tokens are single-token decodes
    backend: "AttentionBackend"
    # decodes: one row per decode token
    decode_block_tables: torch.Tensor | None  # [D, max_blocks]
    decode_context_lens: torch.Tensor | None  # [D]: tokens each decode attends to (itself included); 0 = padding
    decode_mask: torch.Tensor | None = None  # [D, 1, 1, max_blocks*block_size] bool (True = attend); sdpa only
    decode_num_splits: int = 1  # triton: context slices per decode (split-KV)
    # prefills: one row per request with a prefill chunk
    prefill_block_tables: torch.Tensor | None = None  # [P, max_blocks]
    prefill_q_starts: torch.Tensor | None = None  # [P] first row of each chunk in the step
    prefill_q_lens: torch.Tensor | None = None  # [P] rows of each chunk
    prefill_ctx_lens: torch.Tensor | None = None  # [P] tokens cached before each chunk
    prefill_max_q: int = 0
    prefill_mask: torch.Tensor | None = None  # [P, 1, max_q, max_blocks*block_size] bool; sdpa/cpu only
    prefill_gather: torch.Tensor | None = None  # [P, max_q] long: flat token index of each padded query row
    prefill_scatter: torch.Tensor | None = None  # [Tp] long: padded row (p*max_q+i) of each prefill token
    sliding_window: int | None = None

    @property
    def has_prefill(self) -> bool:
        return self.prefill_block_tables is not None


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, Hk, D] x [B, nb] -> [B, Hk, nb*bs, D] (each block read once)."""
    b, nb = block_tables.shape
    kv = cache[block_tables]  # [B, nb, bs, Hk, D]
    return kv.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)


def _sdpa_decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Grouped-query attention with one query per request: the G query heads that share a
    KV head become G query *rows* of that head ([D, Hk, G, Dh]), so each KV head is read
    once for its whole group and nothing is expanded to Hq heads.  Query head h uses KV
    head h // G (HF's repeat_interleave), which is exactly this view."""
    nd = q.shape[0]
    hk = k_cache.shape[2]
    qd = q.view(nd, hk, q.shape[1] // hk, q.shape[2])
    kd = _gather_kv(k_cache, meta.decode_block_tables)
    vd = _gather_kv(v_cache, meta.decode_block_tables)
    od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale)
    return od.reshape(nd, q.shape[1], q.shape[2])


def _sdpa_prefill(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """The prefill rows' output [Tp, Hq, D], through SDPA over gathered blocks."""
    qp = q[meta.prefill_gather].transpose(1, 2)  # [P, Hq, max_q, Dh]
    kp = _gather_kv(k_cache, meta.prefill_block_tables)
    vp = _gather_kv(v_cache, meta.prefill_block_tables)
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=meta.prefill_mask, scale=scale, enable_gqa=True)
    return op.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])[meta.prefill_scatter]


def _to(x: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if x is None else x.to(device, non_blocking=True)


class AttentionBackend:
    """How a layer writes its K/V and attends.  The reference: SDPA over gathered blocks."""

    name = "sdpa"
    decode_masks = True  # `metadata` builds `decode_mask`
    prefill_masks = True  # `metadata` builds `prefill_mask`, `prefill_gather`, `prefill_scatter`
    graphable = False  # decode steps can be captured in a CUDA graph

    def __init__(self, sliding_window: int | None = None):
        self.sliding_window = sliding_window

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
                                 decode_context_lens=_to(decode_context_lens, device),
                                 sliding_window=self.sliding_window)
        window = self.sliding_window
        if num_decode and self.decode_masks:
            ctx, length = decode_context_lens, decode_block_tables.shape[1] * block_size
            j = torch.arange(length).unsqueeze(0)
            mask = j < ctx.unsqueeze(1)
            if window is not None:
                mask &= j >= (ctx - window).unsqueeze(1)
            meta.decode_mask = _to(mask.view(num_decode, 1, 1, length), device)
        if prefill_block_tables is not None:
            cs, ns, offs = prefill_ctx_lens, prefill_q_lens, prefill_q_starts
            max_q = int(ns.max())
            meta.prefill_block_tables, meta.prefill_max_q = _to(prefill_block_tables, device), max_q
            meta.prefill_q_starts, meta.prefill_q_lens = _to(offs, device), _to(ns, device)
            meta.prefill_ctx_lens = _to(cs, device)
            if self.prefill_masks:
                length = prefill_block_tables.shape[1] * block_size
                ar = torch.arange(max_q).unsqueeze(0)
                row = torch.minimum(ar, (ns - 1).unsqueeze(1))  # padded rows repeat the last real query
                qpos = (cs.unsqueeze(1) + row).unsqueeze(2)
                j = torch.arange(length).view(1, 1, length)
                mask = j <= qpos
                if window is not None:
                    mask &= j > qpos - window
                meta.prefill_mask = _to(mask.unsqueeze(1), device)
                meta.prefill_gather = _to(offs.unsqueeze(1) + row, device)
                valid = ar < ns.unsqueeze(1)
                p = prefill_block_tables.shape[0]
                meta.prefill_scatter = _to(torch.arange(p * max_q).view(p, max_q)[valid], device)
        return meta

    def decode_metadata(self, slot_mapping: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor) -> AttentionMetadata:
        """A decode-only step's metadata over tensors already on the device (the persistent
        buffers CUDA graphs replay: runner/cuda_graphs.py); no host work, no masks."""
        return AttentionMetadata(slot_mapping=slot_mapping, num_decode=block_tables.shape[0], backend=self,
                                 decode_block_tables=block_tables, decode_context_lens=context_lens,
                                 sliding_window=self.sliding_window)

    def attend(self, meta: AttentionMetadata) -> Callable:
        """This step's attention, as every layer calls it: (q, k_cache, v_cache, scale) -> [T, Hq, D],
        the step's K/V already written.  Made once per step, so a layer runs no checks."""
        def attend(q, k_cache, v_cache, scale):
            return paged_attention(q, None, None, k_cache, v_cache, meta, scale)

        return attend

    def write_kv(self, k, v, k_cache, v_cache, slot_mapping) -> None:
        k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return _sdpa_decode(q, k_cache, v_cache, meta, scale)

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, out: torch.Tensor) -> None:
        out[meta.num_decode:] = _sdpa_prefill(q, k_cache, v_cache, meta, scale)


class CpuAttention(AttentionBackend):
    """Decodes through our C++ kernel, which reads each block in place once; prefills (and,
    with a sliding window, decodes) through SDPA's masks."""

    name = "cpu"

    def __init__(self, decode_op: Callable, sliding_window: int | None):
        super().__init__(sliding_window)
        self.decode_op = decode_op  # (q, k_cache, v_cache, block_tables, context_lens, scale) -> out
        self.decode_masks = sliding_window is not None  # the kernel has no window: SDPA then

    def attend(self, meta):
        if meta.has_prefill or not meta.num_decode or meta.decode_mask is not None:
            return super().attend(meta)
        # decode rows only: straight to the kernel, nothing between a layer and it
        op, tables, lens = self.decode_op, meta.decode_block_tables, meta.decode_context_lens

        def attend_decodes(q, k_cache, v_cache, scale):
            return op(q, k_cache, v_cache, tables, lens, scale)

        return attend_decodes

    def decode(self, q, k_cache, v_cache, meta, scale):
        if meta.decode_mask is not None:
            return _sdpa_decode(q, k_cache, v_cache, meta, scale)
        return self.decode_op(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale)


class TritonAttention(AttentionBackend):
    """Our Triton kernels (kernels/triton/paged_attention.py): nothing gathered, no masks,
    no host synchronisation."""

    name = "triton"
    decode_masks = False
    prefill_masks = False
    graphable = True

    def __init__(self, sliding_window: int | None, num_kv_heads: int, device: torch.device):
        from tokenloom.kernels.triton import decode_num_splits, fused, paged_attention

        super().__init__(sliding_window)
        self._fused, self._pa = fused, paged_attention
        # split-KV decode sizes its splits to the SMs; on CPUs (Triton's interpreter, in tests)
        # a pretend 4, so the splits and their merge are exercised there too
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
        self._num_splits = lambda b: decode_num_splits(b, num_kv_heads, num_sms)

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

    def decode(self, q, k_cache, v_cache, meta, scale):
        return self._pa.paged_decode(q, k_cache, v_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                                     num_splits=meta.decode_num_splits, window=meta.sliding_window)

    def prefill(self, q, k_cache, v_cache, meta, scale, out):
        self._pa.paged_prefill(q, k_cache, v_cache, meta.prefill_block_tables, meta.prefill_q_starts,
                               meta.prefill_q_lens, meta.prefill_ctx_lens, meta.prefill_max_q, scale, out,
                               window=meta.sliding_window)


def paged_attention(
    q: torch.Tensor,  # [T, Hq, D]
    k: torch.Tensor | None,  # [T, Hk, D]; None: already written (a fused rotary + KV write op)
    v: torch.Tensor | None,  # [T, Hk, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend. Returns [T, Hq, D]."""
    backend = meta.backend
    if k is not None:
        backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    nd = meta.num_decode
    od = backend.decode(q[:nd], k_cache, v_cache, meta, scale) if nd else None
    if not meta.has_prefill:  # a decode-only step: the decodes' output is the whole answer, no copy
        return od if od is not None else torch.empty_like(q)
    out = torch.empty_like(q)
    if nd:
        out[:nd] = od
    backend.prefill(q, k_cache, v_cache, meta, scale, out)
    return out


def build_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int, num_kv_heads: int,
                  sliding_window: int | None) -> AttentionBackend:
    """The attention backend `name` as the backend plan (model/backends.py) resolved it; nothing is chosen here."""
    if name == "triton":
        return TritonAttention(sliding_window, num_kv_heads, device)
    if name == "cpu":
        from tokenloom.kernels import cpu as cpu_kernels

        return CpuAttention(cpu_kernels.decode_attention_op(device, dtype, head_dim), sliding_window)
    return AttentionBackend(sliding_window)
