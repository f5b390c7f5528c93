"""The reference our paged decode attention kernels are tested against: PyTorch's SDPA in
float32 over the requests' blocks gathered into a dense copy, masked past each context."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenloom.model.attention import _gather_kv


def paged_sdpa(q, k_cache, v_cache, tables, ctx, scale) -> torch.Tensor:
    """[N, Hq, D] float32 for q [N, Hq, D], caches [blocks, block_size, Hk, D], tables [N, per]."""
    n, hq, d = q.shape
    hk = k_cache.shape[2]
    length = tables.shape[1] * k_cache.shape[1]
    mask = (torch.arange(length)[None] < ctx[:, None]).view(n, 1, 1, length)
    return F.scaled_dot_product_attention(
        q.float().view(n, hk, hq // hk, d), _gather_kv(k_cache.float(), tables), _gather_kv(v_cache.float(), tables),
        attn_mask=mask, scale=scale).reshape(n, hq, d)
