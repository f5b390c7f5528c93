"""Our decode GEMMs (kernels/cpu_gemm.cpp; cpu_gemm_avx512.cpp and cpu_gemm_bf16.cpp where
the CPU has AVX-512 and AVX512-BF16) against torch's matmul, our paged decode attention against SDPA, and the
whole model on each CPU matmul path against transformers.

The engine picks the kernel by CPU (cpu_kernels.preferred); these tests force each path with
TOKENLOOM_CPU_GEMM so both are proven on whatever machine runs the suite."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from tokenloom import LLM, SamplingParams
from tokenloom.kernels import cpu as cpu_kernels

from attention_reference import paged_sdpa

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="needs an x86 CPU with AVX2+FMA and a C++ toolchain")


@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 40) | st.sampled_from([193, 400]),  # decode rows, and prefill past one m-block (192)
    k=st.integers(1, 600),  # crosses the 256 / 512 k-blocks
    n=st.integers(1, 70),  # full panels of 16 and a ragged last one
    bf16=st.booleans(),
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_kernel_matches_matmul(m, k, n, bf16, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = torch.ops.tokenloom_cpu.linear(x, cpu_kernels.pack(w), n, cpu_kernels.pad_bias(bias, n))
    ref = x.float() @ w.float().t() + (0 if bias is None else bias)
    assert y.shape == (m, n) and y.dtype == dtype
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    tol = 1e-2 * (1 + scale) if bf16 else 1e-4 * k**0.5  # bf16: the output is rounded to 8 bits of mantissa
    assert torch.allclose(y.float(), ref, atol=tol, rtol=1e-4)


@pytest.mark.skipif(not cpu_kernels.avx512_enabled(), reason="needs AVX-512")
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 40) | st.sampled_from([241, 400]),  # decode rows (tiles of 12), prefill past an m-block (240)
    k=st.integers(1, 600),  # crosses the 128-row k-blocks
    n=st.integers(1, 90),  # whole 32-column panels, a last one of <= 16 columns (one half), a ragged one
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
@example(m=1, k=896, n=40, with_bias=True, seed=0)  # one row (x read in place), a last panel of 8 columns
def test_avx512_kernel_matches_matmul(m, k, n, with_bias, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g) if with_bias else None
    y = torch.ops.tokenloom_avx512.linear(x, cpu_kernels.pack(w, cpu_kernels.WIDE), n, cpu_kernels.pad_bias(bias, n))
    ref = x @ w.t() + (0 if bias is None else bias)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert torch.allclose(y, ref, atol=1e-4 * k**0.5, rtol=1e-4)


@pytest.mark.parametrize("width", [cpu_kernels.NR, cpu_kernels.WIDE])
def test_packed_rows_read_the_original_rows(width):
    w = torch.randn(37, 11)
    packed = cpu_kernels.pack(w, width)
    panels = -(-37 // width)
    assert packed.shape == (panels, 11, width)
    assert torch.all(packed[-1, :, 37 - (panels - 1) * width:] == 0)  # zero padding
    assert torch.equal(packed[0, 3], w[:width, 3])  # out[p, k, c] = W[width p + c, k]
    ids = torch.tensor([[0, 36], [15, 16], [31, 32]])
    assert torch.equal(cpu_kernels.packed_rows(packed, ids, 11), w[ids])


needs_bf16 = pytest.mark.skipif(not cpu_kernels.bf16_enabled(), reason="needs AVX512-BF16")


@needs_bf16
@settings(max_examples=40, deadline=None)
@given(
    m=st.integers(0, 40) | st.sampled_from([241, 400]),  # decode rows, and prefill past one m-block (240)
    k=st.integers(1, 1100),  # odd k (a zero-padded pair), and past the 128-pair k-block
    n=st.integers(1, 70),  # whole 32-column panels, a last one of <= 16 columns (one half), a ragged one
    with_bias=st.booleans(),
    seed=st.integers(0, 2**16),
    way=st.sampled_from(["linear", "linear_fma"]),
)
@example(m=1, k=896, n=40, with_bias=True, seed=0, way="linear")  # one row: its pairs read in place
@example(m=1, k=895, n=17, with_bias=False, seed=0, way="linear")  # one row with odd k: packed with a zero partner
@example(m=1, k=895, n=17, with_bias=False, seed=0, way="linear_fma")
def test_bf16_pairs_kernel_matches_matmul(m, k, n, with_bias, seed, way):
    """Both ways of multiplying the pairs panels: the dot-product instruction (`linear`) and
    float32 FMAs on the widened weights (`linear_fma`)."""
    op = getattr(torch.ops.tokenloom_bf16, way)
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g).bfloat16()
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g) if with_bias else None
    y = op(x, cpu_kernels.pack_pairs(w), n, cpu_kernels.pad_bias(bias, n))
    ref = x.float() @ w.float().t() + (0 if bias is None else bias)  # bf16 products are exact in fp32
    assert y.shape == (m, n) and y.dtype == torch.bfloat16
    scale = float(ref.abs().max()) if ref.numel() else 0.0
    assert torch.allclose(y.float(), ref, atol=1e-2 * (1 + scale), rtol=1e-2)  # the output is rounded to bf16
    # the kernel's own rounding of its float32 sums is PyTorch's: a float32 x (the same values)
    # gets the float32 sums back, and rounding those gives y bit for bit
    y32 = op(x.float(), cpu_kernels.pack_pairs(w), n, cpu_kernels.pad_bias(bias, n))
    assert y32.dtype == torch.float32 and torch.equal(y32.bfloat16(), y)


@pytest.mark.parametrize("kernel", ["bf16", "bf16_fma", "avx512"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kernel):
    """Batch invariance: row i of an M-row call is bit for bit row i of a 1-row call, for any
    M.  Speculative decoding relies on it: a verifying step multiplies k + 1 rows where plain
    decode multiplies one, and greedy output must not change (in bfloat16 two logits can tie,
    and a different summation order picks the other)."""
    if kernel.startswith("bf16") and not cpu_kernels.bf16_enabled() or kernel == "avx512" and not cpu_kernels.avx512_enabled():
        pytest.skip(f"needs the {kernel} kernel")
    g = torch.Generator().manual_seed(7)
    n, k = 70, 1000
    w = torch.randn(n, k, generator=g)
    x = torch.randn(40, k, generator=g)
    if kernel.startswith("bf16"):  # bfloat16 values, float32 x: the float32 sums come back unrounded
        w, x = w.bfloat16(), x.bfloat16().float()
        op = torch.ops.tokenloom_bf16.linear_fma if kernel == "bf16_fma" else torch.ops.tokenloom_bf16.linear
        packed = cpu_kernels.pack_pairs(w)
    else:
        op, packed = torch.ops.tokenloom_avx512.linear, cpu_kernels.pack(w, cpu_kernels.WIDE)
    one = torch.cat([op(x[i:i + 1], packed, n, None) for i in range(len(x))])
    for m in (2, 3, 5, 12, 13, 17, 40):
        assert torch.equal(op(x[:m], packed, n, None), one[:m]), m


@needs_bf16
def test_bf16_way_is_chosen_by_measured_rates(monkeypatch):
    """`bf16_dot` takes the FMA way only where it measured clearly faster, and the GEMM op
    follows the choice; the variable forces either."""
    dp, fma = torch.ops.tokenloom_bf16.dot_rates().tolist()
    assert dp > 1e9 and fma > 1e9  # multiply-adds per second of one core: both ran
    cpu_kernels.bf16_dot.cache_clear()
    try:
        assert cpu_kernels.bf16_dot() in ("dpbf16", "fma")
        for forced in ("dpbf16", "fma"):
            monkeypatch.setenv("TOKENLOOM_BF16_DOT", forced)
            cpu_kernels.bf16_dot.cache_clear()
            assert cpu_kernels.bf16_dot() == forced
            packed = cpu_kernels.pack_pairs(torch.ones(32, 4).bfloat16())
            want = torch.ops.tokenloom_bf16.linear_fma if forced == "fma" else torch.ops.tokenloom_bf16.linear
            assert cpu_kernels.linear_op(packed) is want
    finally:
        monkeypatch.delenv("TOKENLOOM_BF16_DOT", raising=False)
        cpu_kernels.bf16_dot.cache_clear()


def test_packed_rows_read_the_original_rows_of_the_pairs_layout():
    w = torch.randn(37, 11).bfloat16()
    packed = cpu_kernels.pack_pairs(w)
    assert packed.shape == (2, 6, 32, 2) and torch.all(packed[:, 5, :, 1] == 0)  # odd k: a zero partner
    assert torch.all(packed[1, :, 5:] == 0)  # the last panel's missing columns
    assert torch.equal(packed[1, 2, 3], w[32 + 3, 4:6])
    ids = torch.tensor([[0, 36], [15, 16], [31, 32]])
    assert torch.equal(cpu_kernels.packed_rows(packed, ids, 11), w[ids])


@pytest.mark.parametrize("path_name", ["own", "onednn"])
def test_each_cpu_matmul_path_matches_transformers(model_factory, monkeypatch, path_name):
    """Greedy tokens equal transformers' under chunking and preemption on the tied-embedding
    model, with every matmul through our kernel or through oneDNN; bf16 stays close."""
    from tests.test_parity import STRESS, _hf, _hf_greedy, _prompts
    from tokenloom.model.weights.packed_linear import PanelEmbedding, PanelLinear

    monkeypatch.setenv("TOKENLOOM_CPU_GEMM", path_name)
    path = model_factory("tiny-qwen2")
    prompts = _prompts(4)
    llm = LLM(str(path), **STRESS)
    model = llm.llm_engine.runner.model
    assert isinstance(model.lm_head, PanelLinear) == (path_name == "own")
    assert isinstance(model.embed_tokens, PanelEmbedding) == (path_name == "own")
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(_hf(path), prompts, 16)
    assert llm.llm_engine.scheduler.num_preemptions > 0

    llm16 = LLM(str(path), dtype="bfloat16", max_model_len=128, num_kv_blocks=64)
    head16 = llm16.llm_engine.runner.model.lm_head
    # bf16 on an AVX512-BF16 CPU: our k-pair kernel, whatever TOKENLOOM_CPU_GEMM says for fp32
    assert (isinstance(head16, PanelLinear) and head16.weight.dim() == 4) == (
        path_name == "own" and cpu_kernels.bf16_enabled())
    o = llm16.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=1, logprobs=5),
                       use_tqdm=False)[0]
    with torch.no_grad():
        ref = _hf(path, torch.bfloat16)(torch.tensor([prompts[0]])).logits[0, -1].float().log_softmax(-1)
    for tok, lp in o.outputs[0].logprobs[0].items():
        assert abs(lp.logprob - ref[tok].item()) < 0.1


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 6),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 3, 7, 8]),
    # 8, 80: tails of the AVX2 64-wide value loop; 16..128: the AVX-512 loop's 1..8 vectors
    # (with 1..8 query heads per register tile); 144: past it, back to the AVX2 loop
    head_dim=st.sampled_from([8, 16, 32, 48, 64, 80, 128, 144]),
    block_size=st.sampled_from([1, 4, 16, 20]),
    bf16=st.booleans(),
    wide=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_paged_decode_attention_matches_sdpa(n, kv_heads, group, head_dim, block_size, bf16, wide, seed):
    """Our kernel reads the blocks in place; the reference gathers them and runs SDPA.
    `wide`: the AVX-512 build of the same source, where the CPU has it."""
    g = torch.Generator().manual_seed(seed)
    dtype = torch.bfloat16 if bf16 else torch.float32
    num_blocks, per_req = 40, 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(n, kv_heads * group, head_dim, generator=g).to(dtype)
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:per_req] for _ in range(n)])
    ctx = torch.randint(1, per_req * block_size + 1, (n,), generator=g)
    scale = head_dim**-0.5
    op = cpu_kernels.attention_op() if wide else torch.ops.tokenloom_cpu.paged_decode_attention
    out = op(q, k_cache, v_cache, tables, ctx, scale)
    ref = paged_sdpa(q, k_cache, v_cache, tables, ctx, scale)
    assert out.dtype == dtype
    assert torch.allclose(out.float(), ref, atol=2e-2 if bf16 else 1e-5)


# float32: within float rounding of the reference; bfloat16: within one bf16 step (the kernels
# round where the reference's ops do, but sum in another order)
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 9), hidden=st.sampled_from([1, 7, 8, 64, 72, 130, 896]), strided=st.booleans(),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fused_rms_norm_matches_the_reference(rows, hidden, strided, dtype, seed):
    """One pass per row vs HF's RMSNorm (pow, mean, rsqrt, two muls; float32 inside, rounded
    like the reference in bfloat16), alone and after the residual add."""
    from tokenloom.model.layers import RMSNorm

    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, 2 * hidden if strided else hidden, generator=g) * 3).to(dtype)
    if strided:  # a view of a wider row, like q out of the fused qkv projection
        x = x[:, :hidden]
    norm = RMSNorm(hidden, 1e-6).to(dtype)
    tol = TOL[dtype]
    with torch.no_grad():
        norm.weight.copy_(torch.randn(hidden, generator=g))
        ref = norm(x)
        out = torch.ops.tokenloom_cpu.rms_norm(x, norm.weight, norm.eps)
    assert out.shape == ref.shape and out.dtype == dtype
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol)
    # with the residual add before it: (norm(x + residual), x + residual)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    with torch.no_grad():
        ref_sum = x + residual
        out, out_sum = torch.ops.tokenloom_cpu.add_rms_norm(x, residual, norm.weight, norm.eps)
    assert torch.equal(out_sum, ref_sum)
    assert torch.allclose(out.float(), norm(ref_sum).float(), rtol=tol, atol=tol)


@settings(max_examples=30, deadline=None)
@given(rows=st.integers(0, 9), inter=st.sampled_from([1, 5, 8, 16, 100, 4864]),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_fused_silu_and_mul_matches_the_reference(rows, inter, dtype, seed):
    """SiLU(gate) * up from the fused gate/up output, extreme gates included (no NaN, no inf);
    the AVX-512 op (cpu_fused_avx512.cpp) too, bit for bit the AVX2 op's where that one is
    vectorized (rows of a multiple of 8)."""
    import torch.nn.functional as F

    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * inter, generator=g) * 4
    if rows and inter > 1:
        gu[0, 0], gu[0, 1] = -200.0, 200.0  # far past exp's float range either way
    gu = gu.to(dtype)
    out = torch.ops.tokenloom_cpu.silu_and_mul(gu)
    gate, up = gu.split(inter, dim=-1)
    ref = F.silu(gate) * up
    assert out.shape == ref.shape and out.dtype == dtype and torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
    if cpu_kernels.avx512_enabled():
        wide = torch.ops.tokenloom_avx512.silu_and_mul(gu)
        assert wide.shape == ref.shape and wide.dtype == dtype and torch.isfinite(wide).all()
        assert torch.allclose(wide.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])
        if inter % 8 == 0:
            assert torch.equal(wide, out)


def test_avx512_silu_rounds_odd_values_as_the_avx2_op():
    """bfloat16 SwiGLU where the CPU converts to bfloat16 itself (AVX512-BF16): the conversion
    takes denormals as zero and keeps NaN payloads, so vectors holding those (or zeros) round
    as the AVX2 op does; every bit equal, with a gate of -200 beside small ups (denormal
    products), zero gates, denormal ups and a NaN."""
    if not cpu_kernels.avx512_enabled():
        pytest.skip("no AVX-512 here")
    g = torch.Generator().manual_seed(0)
    gu = torch.randn(9, 2 * 4864, generator=g) * 4
    gu[0, :300] = -200.0
    gu[1, :300] = 0.0
    gu[2, 4864:5100] = 1e-39
    gu[3, 10] = float("nan")
    x = gu.bfloat16()
    wide, ref = torch.ops.tokenloom_avx512.silu_and_mul(x), torch.ops.tokenloom_cpu.silu_and_mul(x)
    assert torch.equal(wide.view(torch.int16), ref.view(torch.int16))


@settings(max_examples=30, deadline=None)
@given(t=st.integers(0, 7), hq=st.sampled_from([1, 4, 14]), hk=st.sampled_from([1, 2]),
       d=st.sampled_from([2, 8, 64, 128]), seed=st.integers(0, 2**16))
def test_fused_rope_matches_the_reference(t, hq, hk, d, seed):
    """Rotary embedding of q and k read straight out of the fused qkv output (strided views),
    and the variant that writes k and v into the paged KV cache."""
    from tokenloom.model.layers import RotaryEmbedding

    g = torch.Generator().manual_seed(seed)
    rope = RotaryEmbedding(d, 512, 10000.0, None)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g)
    q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    q, k = q.view(t, hq, d), k.view(t, hk, d)
    pos = torch.randint(0, 512, (t,), generator=g)
    ref_q, ref_k = rope(pos, q, k)
    out_q, out_k = torch.ops.tokenloom_cpu.rope(q, k, pos, rope.cos, rope.sin)
    assert torch.allclose(out_q, ref_q, rtol=1e-5, atol=1e-6) and torch.allclose(out_k, ref_k, rtol=1e-5, atol=1e-6)

    # rope_write_kv: the same rotation, k and v written into the paged caches at each token's
    # slot (every other slot untouched), from a qkv whose rows are strided
    wide = torch.randn(t, (hq + 2 * hk) * d + 3, generator=g)
    wide[:, : qkv.shape[1]] = qkv
    blocks, bs = 6, 4
    k_cache, v_cache = (torch.randn(blocks, bs, hk, d, generator=g) for _ in range(2))
    before_k, before_v = k_cache.clone(), v_cache.clone()
    slots = torch.randperm(blocks * bs, generator=g)[:t]
    out_q = torch.ops.tokenloom_cpu.rope_write_kv(wide[:, : qkv.shape[1]], pos, rope.cos, rope.sin, k_cache, v_cache,
                                                  slots, hq, hk)
    assert torch.allclose(out_q, ref_q, rtol=1e-5, atol=1e-6)
    expect_k, expect_v = before_k.view(-1, hk, d).clone(), before_v.view(-1, hk, d).clone()
    expect_k[slots], expect_v[slots] = ref_k, qkv[:, (hq + hk) * d :].reshape(t, hk, d)
    assert torch.allclose(k_cache.view(-1, hk, d), expect_k, rtol=1e-5, atol=1e-6)
    assert torch.equal(v_cache.view(-1, hk, d), expect_v)

    # ... and in bfloat16, rounded where the reference's ops round (the tables, each product, the sum)
    qkv16, k16, v16 = qkv.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    q16, k16_in, v16_in = qkv16.split([hq * d, hk * d, hk * d], dim=-1)
    ref_q16, ref_k16 = rope(pos, q16.view(t, hq, d), k16_in.view(t, hk, d))
    out_q16 = torch.ops.tokenloom_cpu.rope_write_kv(qkv16, pos, rope.cos, rope.sin, k16, v16, slots, hq, hk)
    assert out_q16.dtype == torch.bfloat16 and torch.equal(out_q16, ref_q16)
    assert torch.equal(k16.view(-1, hk, d)[slots], ref_k16)
    assert torch.equal(v16.view(-1, hk, d)[slots], v16_in.reshape(t, hk, d))


@settings(max_examples=60, deadline=None)
@given(rows=st.integers(1, 5), n=st.integers(1, 300) | st.sampled_from([8191, 8192, 20001, 151936]),
       ties=st.booleans(), special=st.sampled_from(["", "nan", "-inf", "-inf then max"]),
       threads=st.sampled_from([1, 2, 3, 4]), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2**16))
def test_argmax_rows_matches_torch(rows, n, ties, special, threads, dtype, seed):
    """Greedy argmax: first index on ties, first NaN if any, 0 for a row of only -inf.  Rows
    fewer than threads are scanned in one stretch per thread (from 8,192 columns), combined in
    order: ties across stretches, a NaN or the only maximum in a later one.  bfloat16 logits
    (a greedy decode step's, read as the head wrote them) give their float32 copy's answer."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, n, generator=g)
    if ties:  # a few distinct values: many ties for the maximum
        x = torch.randint(0, 3, (rows, n), generator=g).float()
    if special == "nan":
        x[0, torch.randint(0, n, (1,), generator=g)] = float("nan")
    elif special == "-inf":
        x[0] = float("-inf")
    elif special == "-inf then max":  # the first part of the row -inf, its maximum (tied) near the end
        x[0, : n * 3 // 4] = float("-inf")
        x[0, -2:] = 1e30
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        x = x.to(dtype)
        assert torch.equal(torch.ops.tokenloom_cpu.argmax_rows(x), x.argmax(dim=-1))
        assert torch.equal(torch.ops.tokenloom_cpu.argmax_rows(x), x.float().argmax(dim=-1))
    finally:
        torch.set_num_threads(before)


def test_the_cpu_fast_path_uses_the_fused_ops(model_factory, monkeypatch):
    """Loaded on CPU in float32, every RMSNorm (and residual add before one), rotary embedding
    and SwiGLU goes through them, chosen once as the ops backend (PyTorch's with
    TOKENLOOM_CPU_FUSED=0); greedy tokens equal transformers' either way."""
    from tests.test_parity import _hf, _hf_greedy, _prompts
    from tokenloom.model.layers import GatedMLP, RMSNorm, RotaryEmbedding

    path = model_factory("tiny-qwen2")  # Qwen2: biases on q/k/v too
    prompts = _prompts(3)
    for fused in ("1", "0"):
        monkeypatch.setenv("TOKENLOOM_CPU_FUSED", fused)
        cpu_kernels.fused_enabled.cache_clear()
        llm = LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=64)
        ops = llm.llm_engine.runner.ops
        assert ops.name == ("cpu" if fused == "1" else "torch")
        model = llm.llm_engine.runner.model
        assert all(m.ops is ops for m in model.modules() if isinstance(m, (RMSNorm, RotaryEmbedding)))
        # the SwiGLU of each GatedMLP runs in its layer's bound step, through the same ops
        assert sum(isinstance(m, GatedMLP) for m in model.modules()) == len(model.steps) > 0
        assert all(step.mlp.act_and_mul == ops.silu_and_mul for step in model.steps)
        assert f"ops backend {ops.name}" in llm.llm_engine.summary()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == _hf_greedy(_hf(path), prompts, 12)
    monkeypatch.undo()  # the cached switch must not outlive this test
    cpu_kernels.fused_enabled.cache_clear()
