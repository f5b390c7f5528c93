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

Two attention calls per layer at most, never a Python loop over requests.  Masks, gather
indices and lengths are built once per step by the model runner (`AttentionMetadata`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "cpu", "triton", "sdpa")


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


class AttentionBackend:
    """How a layer writes its K/V and attends.  The reference: SDPA over gathered blocks."""

    name = "sdpa"
    decode_masks = True  # the runner builds `decode_mask`
    prefill_masks = True  # the runner builds `prefill_mask`, `prefill_gather`, `prefill_scatter`
    graphable = False  # decode steps can be captured in a CUDA graph

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
        self.decode_op = decode_op  # (q, k_cache, v_cache, block_tables, context_lens, scale) -> out
        self.decode_masks = sliding_window is not None  # the kernel has no window: SDPA then

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

    def __init__(self):
        from tokenloom.kernels.triton import fused, paged_attention

        self._fused, self._pa = fused, paged_attention

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


def make_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int,
                 sliding_window: int | None) -> AttentionBackend:
    """The attention backend for `--attention-backend name` on this device, chosen once.

    `auto`: Triton on CUDA where it imports, our C++ kernel on CPUs where it builds, SDPA
    elsewhere.  An explicit choice that cannot run here is an error, not a silent fallback."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.kernels import triton as triton_kernels

    if name not in BACKENDS:
        raise ValueError(f"--attention-backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    cpu_op = cpu_kernels.decode_attention_op(device, dtype, head_dim) if device.type == "cpu" else None
    if name == "auto":
        if device.type == "cuda" and triton_kernels.available():
            name = "triton"
        else:
            name = "cpu" if cpu_op is not None else "sdpa"
    if name == "triton":
        if not triton_kernels.available():
            raise ValueError("--attention-backend triton: the triton package is not importable (pip install triton)")
        if device.type == "cpu" and not triton_kernels.interpreting():
            raise ValueError("--attention-backend triton runs on CUDA devices; on CPU tensors only under "
                             "TRITON_INTERPRET=1 (Triton's interpreter, for tests)")
        if device.type not in ("cuda", "cpu"):
            raise ValueError(f"--attention-backend triton does not run on {device.type} devices")
        return TritonAttention()
    if name == "cpu":
        if cpu_op is None:
            raise ValueError("--attention-backend cpu needs --device cpu, float32 or bfloat16, a head size that is a "
                             "multiple of 8 and our CPU kernels built (TOKENLOOM_CPU_ATTENTION not 0)")
        return CpuAttention(cpu_op, sliding_window)
    return AttentionBackend()
