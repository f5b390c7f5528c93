"""Our Triton kernels against PyTorch's references, on random paged layouts.

Without a GPU they run on CPU tensors in Triton's interpreter (conftest.py sets
TRITON_INTERPRET=1), in float32 and float16 (the interpreter's bfloat16 arithmetic is not
faithful; bfloat16 is checked on GPUs by the parity tests).  Each example builds a KV
cache whose blocks are handed out in random order, requests whose lengths end anywhere
in a block, and padded rows (length 0, slot -1), and compares with SDPA over the same
keys and values gathered densely."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from tokenloom.kernels.triton import decode_num_splits, fused  # noqa: E402
from tokenloom.kernels.triton.paged_attention import paged_decode, paged_prefill  # noqa: E402
from tokenloom.model.layers import RotaryEmbedding, rotate  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3}


def _sdpa(q, k, v, qpos, scale, window):
    """Reference: q [n, Hq, D] at absolute positions qpos over dense k/v [L, Hk, D]."""
    j = torch.arange(k.shape[0])
    mask = j[None, :] <= qpos[:, None]
    if window:
        mask &= j[None, :] > qpos[:, None] - window
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k.float().transpose(0, 1),
                                         v.float().transpose(0, 1), attn_mask=mask.to(q.device), scale=scale,
                                         enable_gqa=True)
    return out.transpose(0, 1)


def _paged(draw, dtype):
    """A random cache, GQA shape and block size, with blocks handed out in random order."""
    block_size = draw(st.sampled_from([1, 4, 16]))
    hk = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 3, 4]))
    dim = draw(st.sampled_from([16, 24, 64]))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    num_blocks = 96 // block_size + 8
    kc = torch.randn(num_blocks, block_size, hk, dim, generator=g).to(dtype)
    vc = torch.randn(num_blocks, block_size, hk, dim, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    return block_size, hk, hk * group, dim, g, kc, vc, perm


def _dense(cache, table, n, block_size):
    idx = torch.arange(n)
    return cache[table[idx // block_size].long(), idx % block_size]


@settings(max_examples=12, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_paged_decode_matches_sdpa(data, dtype):
    block_size, hk, hq, dim, g, kc, vc, perm = _paged(data.draw, dtype)
    lens = data.draw(st.lists(st.integers(0, 70), min_size=1, max_size=4))  # 0: a padded row
    window = data.draw(st.sampled_from([None, None, 5, 33]))
    splits = data.draw(st.sampled_from([1, 2, 5]))
    width = -(-max(max(lens), 1) // block_size)
    tables = torch.stack([perm.roll(7 * i)[:width] for i in range(len(lens))]).to(torch.int32)
    q = torch.randn(len(lens), hq, dim, generator=g).to(dtype)
    scale = dim ** -0.5
    out = paged_decode(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE),
                       torch.tensor(lens, dtype=torch.int32, device=DEVICE), scale, num_splits=splits,
                       window=window).cpu()
    for i, n in enumerate(lens):
        if n == 0:
            assert torch.equal(out[i], torch.zeros_like(out[i]))
            continue
        ref = _sdpa(q[i:i + 1], _dense(kc, tables[i], n, block_size), _dense(vc, tables[i], n, block_size),
                    torch.tensor([n - 1]), scale, window)
        torch.testing.assert_close(out[i:i + 1].float(), ref, rtol=0, atol=TOL[dtype])


@settings(max_examples=10, deadline=None)
@given(data=st.data(), dtype=st.sampled_from(DTYPES))
def test_paged_prefill_matches_sdpa(data, dtype):
    """Chunks that start after a cached prefix, laid out after some decode rows the kernel
    must leave alone."""
    block_size, hk, hq, dim, g, kc, vc, perm = _paged(data.draw, dtype)
    ctxs = data.draw(st.lists(st.integers(0, 40), min_size=1, max_size=3))
    qlens = [data.draw(st.integers(1, 35)) for _ in ctxs]
    window = data.draw(st.sampled_from([None, None, 6]))
    lead = data.draw(st.integers(0, 3))  # decode rows before the chunks
    width = -(-max(c + n for c, n in zip(ctxs, qlens)) // block_size)
    tables = torch.stack([perm.roll(11 * i)[:width] for i in range(len(ctxs))]).to(torch.int32)
    starts = [lead + sum(qlens[:i]) for i in range(len(qlens))]
    q = torch.randn(lead + sum(qlens), hq, dim, generator=g).to(dtype)
    out = torch.full_like(q, 7.0)
    scale = dim ** -0.5
    i32 = dict(dtype=torch.int32, device=DEVICE)
    res = paged_prefill(q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), tables.to(DEVICE), torch.tensor(starts, **i32),
                        torch.tensor(qlens, **i32), torch.tensor(ctxs, **i32), max(qlens), scale, out.to(DEVICE),
                        window=window).cpu()
    assert torch.equal(res[:lead], out[:lead])  # rows outside the chunks untouched
    for i, (c, n) in enumerate(zip(ctxs, qlens)):
        ref = _sdpa(q[starts[i]:starts[i] + n], _dense(kc, tables[i], c + n, block_size),
                    _dense(vc, tables[i], c + n, block_size), c + torch.arange(n), scale, window)
        torch.testing.assert_close(res[starts[i]:starts[i] + n].float(), ref, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_norm_and_silu_round_like_the_reference(dtype):
    g = torch.Generator().manual_seed(0)
    x, r = torch.randn(5, 48, generator=g).to(dtype), torch.randn(5, 48, generator=g).to(dtype)
    w = torch.randn(48, generator=g).to(dtype)
    s = x + r
    ref = w * (s.float() * torch.rsqrt(s.float().pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    out, res = fused.add_rms_norm(x.to(DEVICE), r.to(DEVICE), w.to(DEVICE), 1e-6)
    assert torch.equal(res.cpu(), s)
    torch.testing.assert_close(out.cpu(), ref, rtol=0, atol=TOL[dtype])
    torch.testing.assert_close(fused.rms_norm(s.to(DEVICE), w.to(DEVICE), 1e-6).cpu(), ref, rtol=0, atol=TOL[dtype])
    gu = torch.randn(3, 2 * 40, generator=g).to(dtype)
    ref = F.silu(gu[:, :40]) * gu[:, 40:]
    torch.testing.assert_close(fused.silu_and_mul(gu.to(DEVICE)).cpu(), ref, rtol=0, atol=TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_write_kv_rotates_writes_and_skips_padded_slots(dtype):
    hq, hk, dim, t = 4, 2, 16, 6
    rope = RotaryEmbedding(dim, 100, 10000.0, None)
    g = torch.Generator().manual_seed(1)
    qkv = torch.randn(t, (hq + 2 * hk) * dim, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 7, 50, 99, 1])
    slots = torch.tensor([0, 5, 9, -1, 39, 2])
    kc = torch.zeros(10, 4, hk, dim, dtype=dtype, device=DEVICE)
    vc = torch.zeros_like(kc)
    q = fused.rope_write_kv(qkv.to(DEVICE), pos.to(DEVICE), rope.cos.to(DEVICE), rope.sin.to(DEVICE), kc, vc,
                            slots.to(DEVICE), hq, hk).cpu()
    h = qkv.view(t, hq + 2 * hk, dim)
    cs = rope.at(pos, dtype)
    torch.testing.assert_close(q, rotate(h[:, :hq], *cs), rtol=0, atol=TOL[dtype])
    real = slots >= 0
    fk, fv = kc.cpu().flatten(0, 1), vc.cpu().flatten(0, 1)
    torch.testing.assert_close(fk[slots[real]], rotate(h[:, hq:hq + hk], *cs)[real], rtol=0, atol=TOL[dtype])
    assert torch.equal(fv[slots[real]], h[real, hq + hk:])
    written = torch.zeros(fk.shape[0], dtype=torch.bool)
    written[slots[real]] = True
    assert fk[~written].abs().sum() == 0 and fv[~written].abs().sum() == 0  # slot -1 wrote nowhere


def test_decode_num_splits():
    assert decode_num_splits(1, 2, 132) == 16  # batch 1: split the context to fill the SMs
    assert decode_num_splits(256, 2, 132) == 1  # enough (request, head) programs already
    assert decode_num_splits(8, 2, 132) == 16
    assert decode_num_splits(32, 2, 132) == 5
