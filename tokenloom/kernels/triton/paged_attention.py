"""Paged attention in Triton: decode and prefill read the KV cache's blocks in place.

The cache of one layer is `[num_blocks, block_size, num_kv_heads, head_dim]` for K and the
same for V; a request's history is the blocks its block table lists, in order.  Neither
kernel gathers those blocks into a dense copy: each program walks the table and loads the
keys and values it needs straight from the cache.

Decode (one query token per request) is split-KV attention:

    grid = (requests, kv heads, splits)
    each program: the G query heads sharing one KV head (GQA) against one slice of the
                  request's context -> a partial output and its log-sum-exp
    merge:        out = sum_s exp(lse_s - lse) * out_s,  lse = log sum_s exp(lse_s)

Splitting the context keeps the GPU busy when there are few requests (one program per
request and KV head would leave most SMs idle at batch 1); with one split the program
writes the final output directly and the merge is skipped.  A request of length 0 (a
padded row of a CUDA graph) writes zeros.

Prefill chunks (many query tokens per request, varlen: their rows sit wherever the step
put them) attend causally to their request's cached prefix *and* to themselves, both read
from the cache after this step's K/V were written:

    grid = (requests, query heads, query tiles of BLOCK_M rows)

Both use the online softmax (running max and sum, rescaled per tile of keys) and respect a
sliding window (a query at position p sees keys p - window < j <= p).  Scores and softmax
are in float32; float32 inputs multiply in IEEE float32 (no TF32), so results stay within
rounding of SDPA's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

NO_WINDOW = 1 << 30  # "no sliding window": larger than any context


def _pow2(n: int, floor: int = 16) -> int:
    return max(floor, triton.next_power_of_2(n))


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"  # only float32 operands read it


@triton.jit
def _attend_tile(q, k_cache, v_cache, table, start, hi, kvh, qpos, window, scale, m, l, acc,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                 CAUSAL: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                 TILE: tl.constexpr, PRECISION: tl.constexpr):
    """One tile of TILE keys from position `start` (below `hi`), read in place through the
    block table row `table`, folded into the running max `m`, sum `l` and output `acc` of
    the query rows `q`.  CAUSAL: row i sees keys qpos[i] - window < j <= qpos[i]."""
    offs = start + tl.arange(0, TILE)
    tmask = offs < hi
    d = tl.arange(0, D_PAD)
    kv_mask = tmask[:, None] & (d < HEAD_DIM)[None, :]
    blk = tl.load(table + offs // BLOCK_SIZE, mask=tmask, other=0).to(tl.int64)
    row = offs % BLOCK_SIZE
    k = tl.load(k_cache + (blk * stride_kb + row * stride_ks + kvh * stride_kh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    s = (tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale).to(tl.float32)  # [rows, TILE]
    if CAUSAL:
        seen = (offs[None, :] <= qpos[:, None]) & (offs[None, :] > qpos[:, None] - window) & tmask[None, :]
    else:
        seen = tmask[None, :]
    s = tl.where(seen, s, float("-inf"))
    m_new = tl.maximum(m, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.exp(s - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    v = tl.load(v_cache + (blk * stride_vb + row * stride_vs + kvh * stride_vh)[:, None] + d[None, :],
                mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l * alpha + tl.sum(p, 1), acc


@triton.jit
def _decode_kernel(
    q_ptr, k_cache, v_cache, block_tables, seq_lens, out_ptr, part_out, part_lse,
    scale, window, num_splits,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, DIRECT: tl.constexpr, PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens + b)
    first = tl.maximum(seq_len - window, 0)
    per_split = tl.cdiv(tl.cdiv(seq_len - first, num_splits), TILE) * TILE
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, seq_len)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, D_PAD], tl.float32)
    for start in range(lo, hi, TILE):
        m, l, acc = _attend_tile(q, k_cache, v_cache, block_tables + b * stride_bt, start, hi, kvh, g, window, scale,
                                 m, l, acc, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                 CAUSAL=False, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE,
                                 PRECISION=PRECISION)

    empty = l == 0.0
    out = acc / tl.where(empty, 1.0, l)[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        tl.store(out_ptr + b * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        # partials: [B, Hq, splits, D_PAD] float32 and [B, Hq, splits]
        hq = tl.num_programs(1) * GROUP
        base = (b * hq + heads) * num_splits + split
        tl.store(part_out + base[:, None] * D_PAD + d[None, :], out, mask=omask)
        lse = tl.where(empty, float("-inf"), m + tl.log(tl.where(empty, 1.0, l)))
        tl.store(part_lse + base, lse, mask=gmask)


@triton.jit
def _merge_kernel(
    part_out, part_lse, out_ptr, num_splits, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    hq = tl.num_programs(1)
    sp = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, D_PAD)
    smask = sp < num_splits
    base = (b * hq + h) * num_splits
    lse = tl.load(part_lse + base + sp, mask=smask, other=float("-inf"))
    top = tl.max(lse, 0)
    w = tl.exp(lse - tl.where(top == float("-inf"), 0.0, top))  # 0 for empty splits
    parts = tl.load(part_out + (base + sp)[:, None] * D_PAD + d[None, :], mask=smask[:, None], other=0.0)
    total = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(out_ptr + b * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


def paged_decode(
    q: torch.Tensor,  # [B, Hq, D], one query token per request
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hk, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32/int64
    seq_lens: torch.Tensor,  # [B] tokens each query attends to (itself included); 0 = a padded row
    scale: float,
    num_splits: int = 1,
    window: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's one new token over its paged KV history -> [B, Hq, D].

    No host synchronisation and no shape that depends on the lengths' values: safe to
    capture in a CUDA graph."""
    bsz, hq, dim = q.shape
    _, block_size, hk, _ = k_cache.shape
    group = hq // hk
    if out is None:
        out = torch.empty_like(q)
    if bsz == 0:
        return out
    assert q.stride(2) == 1 and k_cache.stride(3) == 1 and v_cache.stride(3) == 1
    d_pad = _pow2(dim)
    direct = num_splits == 1
    if direct:
        part_out = part_lse = out  # unused
    else:
        part_out = torch.empty((bsz, hq, num_splits, d_pad), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((bsz, hq, num_splits), dtype=torch.float32, device=q.device)
    _decode_kernel[(bsz, hk, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens, out, part_out, part_lse,
        scale, window or NO_WINDOW, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=_pow2(group), HEAD_DIM=dim, D_PAD=d_pad,
        BLOCK_SIZE=block_size, TILE=32, DIRECT=direct, PRECISION=_precision(q.dtype),
    )
    if not direct:
        _merge_kernel[(bsz, hq)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            HEAD_DIM=dim, D_PAD=d_pad, SPLITS_PAD=_pow2(num_splits, 2),
        )
    return out


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache, v_cache, block_tables, q_starts, q_lens, ctx_lens, out_ptr,
    scale, window,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr, PRECISION: tl.constexpr,
):
    r = tl.program_id(0)
    h = tl.program_id(1)
    tile = tl.program_id(2)
    q_len = tl.load(q_lens + r)
    if tile * BLOCK_M >= q_len:
        return
    q_start = tl.load(q_starts + r)
    ctx = tl.load(ctx_lens + r)  # tokens cached before this chunk
    kvh = h // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < q_len
    qpos = ctx + tl.minimum(rows, q_len - 1)  # rows past the chunk repeat its last query (not stored)
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + (q_start + rows)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)

    lo = tl.maximum(ctx + tile * BLOCK_M - window + 1, 0)
    lo = (lo // TILE) * TILE
    hi = ctx + tl.minimum((tile + 1) * BLOCK_M, q_len)  # one past the last row's position
    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for start in range(lo, hi, TILE):
        m, l, acc = _attend_tile(q, k_cache, v_cache, block_tables + r * stride_bt, start, hi, kvh, qpos, window, scale,
                                 m, l, acc, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                 CAUSAL=True, HEAD_DIM=HEAD_DIM, D_PAD=D_PAD, BLOCK_SIZE=BLOCK_SIZE, TILE=TILE,
                                 PRECISION=PRECISION)
    out = acc / tl.where(l == 0.0, 1.0, l)[:, None]
    tl.store(out_ptr + (q_start + rows)[:, None] * stride_ot + h * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def paged_prefill(
    q: torch.Tensor,  # [T, Hq, D]: the step's query rows (any order of requests)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [P, max_blocks]
    q_starts: torch.Tensor,  # [P] first row of each request's chunk in q
    q_lens: torch.Tensor,  # [P] rows in each chunk
    ctx_lens: torch.Tensor,  # [P] tokens cached before each chunk
    max_q_len: int,
    scale: float,
    out: torch.Tensor,  # [T, Hq, D]: rows of the chunks are written, others left as they are
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of prefill chunks over their cached prefix and themselves, read in
    place from the paged cache (this step's K/V must already be written)."""
    p = q_starts.shape[0]
    if p == 0:
        return out
    _, hq, dim = q.shape
    _, block_size, hk, _ = k_cache.shape
    block_m = 16
    _prefill_kernel[(p, hq, triton.cdiv(max_q_len, block_m))](
        q, k_cache, v_cache, block_tables, q_starts, q_lens, ctx_lens, out,
        scale, window or NO_WINDOW,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=hq // hk, HEAD_DIM=dim, D_PAD=_pow2(dim), BLOCK_SIZE=block_size, BLOCK_M=block_m, TILE=32,
        PRECISION=_precision(q.dtype),
    )
    return out
