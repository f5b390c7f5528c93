"""The AMX GEMMs (kernels/cpu_gemm_amx.cpp) against the reference GEMM, and the AMX probe.

The bf16-tile kernels' products are exact (bf16 x bf16; int8 and int4 values are exact in
bf16) and their sums float32; a float32 x enters as two bf16 planes (2^-17 of each value).
Each is compared with float64 x @ W^T, W dequantized, within those bounds (1e-5 of the sum of
|products| for float32 summation, plus 2^-16 of it for a float32 x).  The int8-tile kernel
splits each activation row into two int8 planes, the limb kernel (cpu_gemm_amx_limbs.cpp) writes
it in fixed point as four byte limbs (sixteen bits for most bf16 rows): their own bounds are
stated in their tests.  Skipped, with the probe's reason,
where this machine's AMX is not usable; failed, not skipped, where our AMX source does not compile
with a compiler that builds tile instructions.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenloom.kernels import amx, amx_probe
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.weights.quantization import dequantize_int4, quantize_int4

from attention_reference import paged_sdpa


def _compiler_takes_amx() -> bool:
    """Whether this machine's C++ compiler builds a tile instruction (gcc >= 11, clang >= 12)."""
    src = "#include <immintrin.h>\nvoid f() { _tile_zero(0); }\n"
    cmd = [os.environ.get("CXX", "c++"), "-mamx-tile", "-mamx-int8", "-mamx-bf16", "-x", "c++", "-c", "-",
           "-o", os.devnull]
    try:
        return subprocess.run(cmd, input=src, capture_output=True, text=True, timeout=120).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _amx_or_skip() -> None:
    if not amx_probe.FLAGS <= cpu_kernels._cpu_flags():
        pytest.skip(f"no AMX here: the CPU lacks {sorted(amx_probe.FLAGS - cpu_kernels._cpu_flags())}")
    if not amx.build():
        # A compiler that builds tile instructions but not our kernels: a bug in our source, not
        # a machine without AMX (the build's error is in the log above).
        assert not _compiler_takes_amx(), "the AMX kernels do not compile here, though the compiler takes AMX"
        pytest.skip("the compiler here builds no AMX instructions")
    if not amx_probe.amx_usable():
        pytest.skip(f"AMX listed but not usable here: {amx_probe.run_probe()[1]}")
    if not cpu_kernels.bf16_enabled():
        pytest.skip("the AVX512-BF16 extension did not build here")


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """y against float64 x @ w^T (+ bias): a bf16 x is exact in the tiles, a float32 one is
    kept as two bf16 planes to 2^-17 of each value (bound 2^-16), plus float32 summation."""
    xr = x.double()
    ref = xr @ w.double().t()
    rel = 1e-5 if x.dtype == torch.bfloat16 else 1e-5 + 2**-16
    bound = rel * (xr.abs() @ w.double().abs().t()) + 1e-6
    if bias is not None:
        ref = ref + bias.double()
    assert y.shape == ref.shape
    err = (y.double() - ref).abs()
    assert (err <= bound).all(), f"max error {err.max().item()} over bound {bound.max().item()}"


shapes = dict(m=st.integers(1, 40), k=st.integers(1, 200), n=st.integers(1, 80), bias=st.booleans(),
              seed=st.integers(0, 2**31 - 1))


@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_amx_bf16_matches_reference(m: int, k: int, n: int, bias: bool, seed: int) -> None:
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    y = torch.ops.tokenloom_amx.linear_bf16(x, cpu_kernels.pack_pairs(w), n, cpu_kernels.pad_bias(b, n))
    assert y.dtype == torch.float32
    _check(y, x, w.float(), b)


def test_amx_bf16_long_prefill_crosses_row_blocks() -> None:
    """A prefill-sized call runs its rows in L2-sized blocks (about 1 MiB of x each: 576 rows at
    896 features): rows on both sides of each block edge, and the last partial block, match."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(4)
    w = torch.randn(70, 896, generator=g).to(torch.bfloat16)
    x = torch.randn(1300, 896, generator=g)
    b = torch.randn(70, generator=g)
    y = torch.ops.tokenloom_amx.linear_bf16(x, cpu_kernels.pack_pairs(w), 70, cpu_kernels.pad_bias(b, 70))
    _check(y, x, w.float(), b)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 1400), n=st.integers(1, 200), bias=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_amx_bf16_decode_rows_match_reference(m: int, k: int, n: int, bias: bool, seed: int) -> None:
    """A bf16 x of a decode step's rows: up to 32 rows, two panels at once, each row tile's pass
    over chunks of k-blocks (several chunks from 512 k on), the odd panel alone; beyond, row
    tile pairs.  The result is x's dtype, bf16: its rounding on top of the summation's."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g).to(torch.bfloat16), torch.randn(n, k, generator=g).to(torch.bfloat16)
    b = torch.randn(n, generator=g) if bias else None
    y = torch.ops.tokenloom_amx.linear_bf16(x, cpu_kernels.pack_pairs(w), n, cpu_kernels.pad_bias(b, n))
    assert y.dtype == torch.bfloat16
    ref = x.double() @ w.double().t() + (b.double() if b is not None else 0)
    scale = x.double().abs() @ w.double().abs().t() + 1
    assert ((y.double() - ref).abs() <= 2**-8 * ref.abs() + 1e-5 * scale).all()


@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_amx_int8_matches_reference(m: int, k: int, n: int, bias: bool, seed: int) -> None:
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) + 0.01
    b = torch.randn(n, generator=g) if bias else None
    packed, scales = cpu_kernels.pack_int8(q, s, quads=True)
    y = torch.ops.tokenloom_amx.linear_int8(x, packed, scales, n, cpu_kernels.pad_bias(b, n))
    assert y.dtype == torch.bfloat16  # x's dtype
    # y is rounded to bf16: its own rounding on top of the summation's.
    ref = x.double() @ (q.double() * s.double()[:, None]).t() + (b.double() if b is not None else 0)
    assert torch.allclose(y.double(), ref, rtol=2**-8, atol=1e-3 * (ref.abs().max().item() + 1))
    y32 = torch.ops.tokenloom_amx.linear_int8(x.float(), packed, scales, n, cpu_kernels.pad_bias(b, n))
    _check(y32, x.float(), q.float() * s[:, None], b)


@settings(max_examples=25, deadline=None)
@given(group=st.sampled_from([32, 64, 128]), **shapes)
def test_amx_int4_matches_reference(group: int, m: int, k: int, n: int, bias: bool, seed: int) -> None:
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    q, s = quantize_int4(w, group)
    for scale_dtype in (torch.bfloat16, torch.float16):
        packed, scales = cpu_kernels.pack_int4(q, s.to(scale_dtype))
        y = torch.ops.tokenloom_amx.linear_int4(x, packed, scales, n, group, cpu_kernels.pad_bias(b, n))
        _check(y, x, dequantize_int4(q, s.to(scale_dtype).float(), k).float(), b)


@settings(max_examples=25, deadline=None)
@given(**shapes)
def test_amx_int8_tiles_within_the_split_bound(m: int, k: int, n: int, bias: bool, seed: int) -> None:
    """int8 tiles (activations split into two int8 planes): each activation is off by at most
    max|x_row| / (127 * 508), so each output by at most that times sum_k |w[n, k]| (plus
    float32 rounding of the sums)."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.rand(m, 1, generator=g) * 10
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) + 0.01
    b = torch.randn(n, generator=g) if bias else None
    packed, scales = cpu_kernels.pack_int8(q, s, quads=True)
    y = torch.ops.tokenloom_amx.linear_int8_tiles(x, packed, scales, n, cpu_kernels.pad_bias(b, n))
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.t() + (b.double() if b is not None else 0)
    step = x.abs().amax(dim=1, keepdim=True).double() / (127 * 508)
    bound = step * w.abs().sum(dim=1)[None] * 1.01 + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6
    assert ((y.double() - ref).abs() <= bound).all()


@settings(max_examples=25, deadline=None)
@given(outlier=st.booleans(), **shapes)
def test_amx_int8_limbs_within_the_limb_bound(outlier: bool, m: int, k: int, n: int, bias: bool, seed: int) -> None:
    """int8 tiles against byte limbs per row (cpu_gemm_amx_limbs.cpp): each float32 activation
    (four limbs) is off by at most 2^-31 of its row's largest value, so each output by at most
    that times sum_k |w[n, k]| (plus float32 rounding of the sums) -- with an outlier channel
    10^4 times the rest too, where per-row int8 planes (`linear_int8_tiles`) lose the rest of
    the row.  A bfloat16 row is off by at most half its unit (next test)."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.logspace(-3, 1, k)
    if outlier:
        x[:, k // 2] = 1e4
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) + 0.01
    b = torch.randn(n, generator=g) if bias else None
    packed, scales = cpu_kernels.pack_int8(q, s, quads=True)
    w = q.double() * s.double()[:, None]
    ref = x.double() @ w.t() + (b.double() if b is not None else 0)
    bound = (x.abs().amax(dim=1, keepdim=True).double() * 2.0**-31 * w.abs().sum(dim=1)[None]
             + 1e-5 * (x.double().abs() @ w.abs().t()) + 1e-6)
    for xin in (x, x.to(torch.bfloat16)):
        y = torch.ops.tokenloom_amx.linear_int8_limbs(xin, packed, scales, n, cpu_kernels.pad_bias(b, n))
        assert y.dtype == xin.dtype
        if xin.dtype == torch.float32:
            assert ((y.double() - ref).abs() <= bound).all()
        else:  # y rounded to bf16: its own rounding on top of the sums
            ref16 = xin.double() @ w.t() + (b.double() if b is not None else 0)
            y32 = torch.ops.tokenloom_amx.linear_int8_limbs(xin.float(), packed, scales, n, cpu_kernels.pad_bias(b, n))
            # A bf16 row whose nonzero values all lie within 2^20 of its largest is written exactly
            # as float32 (only float32 summation is left); a wider row keeps the 2^-31 bound.
            a16 = xin.double().abs()
            rowmax = a16.amax(dim=1, keepdim=True)
            sum_w = w.abs().sum(dim=1)[None]
            exact = (a16.masked_fill(a16 == 0, float("inf")).amin(dim=1, keepdim=True) >= rowmax * 2.0**-20)
            limb = torch.where(exact, 0.0, rowmax * 2.0**-31) * sum_w
            assert ((y32.double() - ref16).abs() <= limb + 1e-5 * (a16 @ w.abs().t()) + 1e-6).all()
            # As bf16: a value at or above 2^7 of the row's unit (2^-31 of the row's largest, or
            # 2^-15 for a row rounded to sixteen bits) is written exactly, a smaller one is off by
            # at most half the unit; the output's own rounding to bf16 on top.
            unit, _ = _bf16_row_units(xin)
            small = (a16 < unit * 2.0**7) & (a16 > 0)
            fixed = (unit / 2) * (small.double() @ w.abs().t())
            err = (y.double() - ref16).abs()
            assert (err <= fixed + 1e-5 * (a16 @ w.abs().t()) + ref16.abs() * 2.0**-8 + 1e-6).all()
            assert torch.allclose(y.double(), ref16, rtol=2**-8, atol=1e-3 * (ref16.abs().max().item() + 1))


def test_amx_int8_limbs_rows_do_not_depend_on_the_rows_beside_them() -> None:
    """Each row is split on its own unit and multiplied by its own tile rows: row i of an M-row
    call is bit for bit the 1-row call, and a row 10^6 times larger beside it changes nothing."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(3)
    q = torch.randint(-127, 128, (70, 300), generator=g, dtype=torch.int8)
    packed, scales = cpu_kernels.pack_int8(q, torch.rand(70, generator=g) + 0.01, quads=True)
    x = torch.randn(20, 300, generator=g)
    x[7] *= 1e6
    x[12, 40] = 1e5  # a bf16 row that keeps all four limbs, in a tile of rounded ones
    for xin in (x, x.bfloat16()):
        one = torch.cat([torch.ops.tokenloom_amx.linear_int8_limbs(xin[i:i + 1], packed, scales, 70, None)
                         for i in range(20)])
        assert torch.equal(torch.ops.tokenloom_amx.linear_int8_limbs(xin, packed, scales, 70, None), one)


def _bf16_row_units(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per bfloat16 row, the limb kernel's unit and whether the row may be rounded to sixteen
    bits (largest |value| <= 2^6 mean |value|; rows within float32 summation of the line count
    as rounded, the looser bound)."""
    a = x.double().abs()
    unit = torch.exp2(torch.floor(torch.log2(a.amax(dim=1, keepdim=True))) - 30)
    narrow = a.amax(dim=1, keepdim=True) * a.shape[1] <= 64 * a.sum(dim=1, keepdim=True) * (1 + 1e-4)
    return torch.where(narrow, unit * 2.0**16, unit), narrow


@pytest.mark.parametrize("m", [1, 9, 16, 23])
def test_amx_int8_limbs_keep_each_bf16_value_to_its_rows_fixed_point(m: int) -> None:
    """A bfloat16 row is written as t = round(x / D), D = 2^(floor(log2 max|x_row|) - 30); a row
    whose largest value is at most 2^6 times its mean |value| on 2^16 D instead (sixteen bits).
    Each value at or above 2^7 of the unit is exact, each smaller one within half the unit.  One
    weight per output (y[j] = x[at[j]] * w[j]) shows each value's own error; rows with an outlier
    channel 10^4 times the rest (every other row) keep thirty-one bits, so sixteen there fails."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(23 + m)
    n, k = 192, 320
    at = torch.randint(0, k, (n,), generator=g)
    q = torch.zeros(n, k, dtype=torch.int8)
    q[torch.arange(n), at] = torch.randint(1, 128, (n,), generator=g, dtype=torch.int8)
    s = torch.rand(n, generator=g) + 0.5
    packed, scales = cpu_kernels.pack_int8(q, s, quads=True)
    w = (q.double() * s.double()[:, None])[torch.arange(n), at]
    x = torch.rand(m, k, generator=g) * torch.logspace(-16, 0, k, base=2.0)[torch.randperm(k, generator=g)]
    x = (x * torch.where(torch.rand(m, k, generator=g) < 0.5, -1.0, 1.0))
    x[::2, 0] = 1e4
    x = x.bfloat16()
    unit, narrow = _bf16_row_units(x)
    assert narrow[1::2].all() and not narrow[::2].any()
    y = torch.ops.tokenloom_amx.linear_int8_limbs(x, packed, scales, n, None).double()
    xa = x.double()[:, at]
    exact = xa.abs() >= unit * 2.0**7
    err = (y - xa * w).abs()
    rounding = (xa * w).abs() * 2.0**-8  # y's own rounding to bfloat16
    assert (err[exact] <= rounding[exact]).all()
    assert (err <= torch.where(exact, 0.0, unit / 2 * w) + rounding).all()
    if m > 1:  # values off the sixteen-bit grid are in the sample
        assert (~exact[1::2]).any() and (err[1::2] > rounding[1::2]).any()


def test_amx_int8_limbs_propagate_inf_and_nan() -> None:
    """A row holding inf or NaN cannot be written as limbs: the call takes the bf16-tile kernel,
    whose float sums carry it to that row's outputs (the other rows stay finite)."""
    _amx_or_skip()
    q = torch.randint(-127, 128, (40, 128), dtype=torch.int8)
    packed, scales = cpu_kernels.pack_int8(q, torch.rand(40) + 0.01, quads=True)
    for bad in (float("nan"), float("inf")):
        x = torch.randn(17, 128)
        x[3, 9] = bad
        y = torch.ops.tokenloom_amx.linear_int8_limbs(x, packed, scales, 40, None)
        assert not torch.isfinite(y[3]).all() and torch.isfinite(torch.cat([y[:3], y[4:]])).all()


def test_amx_rejects_groups_not_a_multiple_of_32() -> None:
    _amx_or_skip()
    q, s = quantize_int4(torch.randn(8, 48), 16)
    packed, scales = cpu_kernels.pack_int4(q, s)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.tokenloom_amx.linear_int4(torch.randn(2, 48), packed, scales, 8, 16, None)


def test_dispatch_picks_by_rows_and_matches_both_kernels(monkeypatch) -> None:
    """A calibration that takes AMX from 8 rows: calls below run our AVX-512 kernel, calls from
    8 rows the AMX one, each exactly as that kernel alone."""
    _amx_or_skip()
    pick = [int(rows >= 8) for rows in amx.BUCKETS]
    monkeypatch.setattr(amx, "choices", lambda: {"bf16": {"names": ["ours", "linear_bf16"], "pick": pick}})
    w = cpu_kernels.pack_pairs(torch.randn(40, 64).to(torch.bfloat16))
    ours = cpu_kernels.linear_op(w)
    op = amx.dispatch("bf16", ours)
    for rows, kernel in ((1, ours), (7, ours), (8, torch.ops.tokenloom_amx.linear_bf16),
                         (100, torch.ops.tokenloom_amx.linear_bf16)):
        x = torch.randn(rows, 64)
        assert torch.equal(op(x, w, 40, None), kernel(x, w, 40, None))


def test_quantized_float32_rows_keep_our_kernel_below_16_rows(monkeypatch) -> None:
    """A calibration that takes AMX for int8 from 9 rows: bf16 rows of 9-15 run it, float32
    rows keep our kernel until 16 (two bf16 planes on AMX, not float32's exact products)."""
    _amx_or_skip()
    if not cpu_kernels.int8_quads():
        pytest.skip("the AMX int8 kernels read the VNNI build's k-quad panels")
    pick = [int(rows >= 9) for rows in amx.BUCKETS]
    monkeypatch.setattr(amx, "choices", lambda: {"int8": {"names": ["ours", "linear_int8"], "pick": pick}})
    q = torch.randint(-127, 128, (40, 64), dtype=torch.int8)
    packed, scales = cpu_kernels.pack_int8(q, torch.rand(40) + 0.01, quads=True)
    ours = cpu_kernels.quant_ops().linear_int8
    op = amx.dispatch("int8", ours)
    tiles = torch.ops.tokenloom_amx.linear_int8
    for rows, dtype, kernel in ((8, torch.bfloat16, ours), (12, torch.bfloat16, tiles), (12, torch.float32, ours),
                                (16, torch.float32, tiles), (40, torch.float32, tiles)):
        x = torch.randn(rows, 64).to(dtype)
        assert torch.equal(op(x, packed, scales, 40, None), kernel(x, packed, scales, 40, None)), (rows, dtype)


def test_a_call_falls_in_the_largest_bucket_at_or_below_its_rows() -> None:
    """Buckets are timed at their own row count; 9 has one, since from 9 rows our quantized
    kernels leave the VNNI integer path (8 rows' timing would pick for a kernel not run)."""
    assert 8 in amx.BUCKETS and 9 in amx.BUCKETS and amx.MIN_QUANT_ROWS == 9
    for rows in range(0, 200):
        b = amx.BUCKETS[amx.bucket(rows)]
        assert b <= max(rows, 1) and all(not b < other <= rows for other in amx.BUCKETS)


def test_calibration_is_cached_beside_the_builds(tmp_path, monkeypatch) -> None:
    _amx_or_skip()
    monkeypatch.setenv("TOKENLOOM_KERNEL_CACHE", str(tmp_path))
    calls = []

    def fake_calibrate():
        calls.append(1)
        return {k: {"names": ["ours", f"linear_{k}"], "pick": [1] * len(amx.BUCKETS), "ms": []} for k in amx.KINDS}

    monkeypatch.setattr(amx, "calibrate", fake_calibrate)
    amx.choices.cache_clear()
    try:
        assert amx.choices()["int8"]["pick"][0] == 1
        amx.choices.cache_clear()
        assert amx.choices()["bf16"]["pick"][-1] == 1 and len(calls) == 1  # the second process reads the file
        files = list(tmp_path.glob("amx_calibration_*.json"))
        assert len(files) == 1 and json.loads(files[0].read_text())["bf16"]["names"] == ["ours", "linear_bf16"]
    finally:
        amx.choices.cache_clear()


def test_probe_says_yes_on_this_machine_when_cpuinfo_lists_amx() -> None:
    if not amx_probe.FLAGS <= cpu_kernels._cpu_flags():
        pytest.skip("the CPU does not list AMX")
    usable, why = amx_probe.run_probe()
    # A VM may list AMX and trap on it: then the probe must say so, with a reason, not crash.
    assert isinstance(usable, bool) and why
    if usable:
        assert "correct" in why


def test_probe_that_traps_reports_false_without_crashing(monkeypatch) -> None:
    """The child dies of SIGILL, as on a CPU or VM that traps tile instructions: the caller
    gets False and a reason, and the forced failure is not cached as this machine's verdict."""
    if not amx_probe.FLAGS <= cpu_kernels._cpu_flags():
        pytest.skip("the CPU does not list AMX")
    monkeypatch.setenv("TOKENLOOM_AMX_PROBE_FAIL", "1")
    usable, why = amx_probe.run_probe()
    assert usable is False and "exited with" in why
    assert amx_probe.amx_usable() is False
    monkeypatch.delenv("TOKENLOOM_AMX_PROBE_FAIL")
    monkeypatch.setenv("TOKENLOOM_AMX", "0")
    assert amx_probe.amx_usable() is False


@settings(max_examples=30, deadline=None)
@given(n=st.integers(1, 5), kv_heads=st.sampled_from([1, 2, 4]), group=st.sampled_from([1, 3, 7, 16, 20]),
       head_dim=st.sampled_from([32, 64, 96, 128]), block_size=st.sampled_from([1, 4, 16, 20, 32]),
       seed=st.integers(0, 2**16))
def test_amx_decode_attention_matches_sdpa(n, kv_heads, group, head_dim, block_size, seed) -> None:
    """cpu_attention_amx.cpp: q.k and p.v as tile products (keys as dimension pairs, values as
    token pairs, P rounded to bf16), against SDPA over the gathered blocks in float32; more
    than 16 query heads per KV head (20) take two passes, partial chunks zeros."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    num_blocks, per_req = 40, 5
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(n, kv_heads * group, head_dim, generator=g).bfloat16()
    tables = torch.stack([torch.randperm(num_blocks, generator=g)[:per_req] for _ in range(n)])
    ctx = torch.randint(1, per_req * block_size + 1, (n,), generator=g)
    scale = head_dim**-0.5
    op = torch.ops.tokenloom_amx.paged_decode_attention
    if not {"TOKENLOOM_AMX", "TOKENLOOM_CPU_ATTENTION"} & set(os.environ):  # chosen where AMX runs
        assert amx.decode_attention_op(torch.device("cpu"), torch.bfloat16, head_dim) is op
    out = op(q, k_cache, v_cache, tables, ctx, scale)
    ref = paged_sdpa(q, k_cache, v_cache, tables, ctx, scale)
    assert out.dtype == torch.bfloat16 and out.shape == ref.shape
    # bf16 output (2^-9 of |v| <= ~4.5) and P rounded to bf16 (2^-9 of each weight)
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=0)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(2, 6), kv_heads=st.sampled_from([1, 2, 3, 4]), group=st.sampled_from([1, 3, 4, 7, 8, 12, 16]),
       head_dim=st.sampled_from([32, 64, 128]), block_size=st.sampled_from([16, 32, 48]),
       seed=st.integers(0, 2**16))
def test_amx_decode_attention_keys_in_place_ignore_unwritten_slots(n, kv_heads, group, head_dim, block_size,
                                                                    seed) -> None:
    """Block sizes of whole 16-token tiles: keys read in place from the cache (16 tokens a
    tile, whatever the slots past the context hold), several KV heads a pass where their query
    heads fill the lanes (7 + 7 of 16).  Every slot past a request's context is NaN, as an
    unwritten cache may be: masked out of the softmax, its value read as zero."""
    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    per_req = 4
    k_cache = torch.randn(n * per_req, block_size, kv_heads, head_dim, generator=g).bfloat16()
    v_cache = torch.randn(n * per_req, block_size, kv_heads, head_dim, generator=g).bfloat16()
    q = torch.randn(n, kv_heads * group, head_dim, generator=g).bfloat16()
    tables = torch.randperm(n * per_req, generator=g).view(n, per_req)  # no block shared
    ctx = torch.randint(1, per_req * block_size + 1, (n,), generator=g)
    for r in range(n):
        for t in range(int(ctx[r]), per_req * block_size):
            k_cache[tables[r, t // block_size], t % block_size] = float("nan")
            v_cache[tables[r, t // block_size], t % block_size] = float("nan")
    scale = head_dim**-0.5
    out = torch.ops.tokenloom_amx.paged_decode_attention(q, k_cache, v_cache, tables, ctx, scale)
    ref = paged_sdpa(q, k_cache.nan_to_num(0), v_cache.nan_to_num(0), tables, ctx, scale)
    assert torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=0)


@settings(max_examples=25, deadline=None)
@given(chunks=st.lists(st.integers(1, 120), min_size=1, max_size=4), row0=st.integers(0, 3),
       kv_heads=st.sampled_from([1, 2, 3]), group=st.sampled_from([1, 3, 7, 8]), head_dim=st.sampled_from([32, 64, 128]),
       block_size=st.sampled_from([16, 32, 48]), seed=st.integers(0, 2**16))
def test_amx_causal_prefill_matches_sdpa(chunks, row0, kv_heads, group, head_dim, block_size, seed) -> None:
    """cpu_attention_amx.cpp `causal_prefill_attention`: prefill chunks that start their
    requests, each query row over its own keys 0..i (16 rows a tile, keys in place, values
    paired once per 32 keys), against SDPA's causal path in float32.  Rows before `row0` (a
    step's decodes) are not the kernel's; every cache slot nobody wrote is NaN."""
    import torch.nn.functional as F

    _amx_or_skip()
    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(chunks)
    per = (max(chunks) + block_size - 1) // block_size
    blocks = len(chunks) * per + 2
    k_cache = torch.full((blocks, block_size, kv_heads, head_dim), float("nan")).bfloat16()
    v_cache = k_cache.clone()
    tables = torch.randperm(blocks, generator=g)[:len(chunks) * per].view(len(chunks), per)
    q = torch.randn(row0 + sum(chunks), kv_heads * group, head_dim, generator=g).bfloat16()
    starts = row0 + torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)[:-1]])
    ref = torch.empty(sum(chunks), kv_heads * group, head_dim)
    for c, n in enumerate(chunks):
        k, v = (torch.randn(n, kv_heads, head_dim, generator=g).bfloat16() for _ in range(2))
        for t in range(n):
            k_cache[tables[c, t // block_size], t % block_size] = k[t]
            v_cache[tables[c, t // block_size], t % block_size] = v[t]
        qc = q[starts[c]:starts[c] + n].float().transpose(0, 1)
        kk, vv = (x.float().transpose(0, 1).repeat_interleave(group, 0) for x in (k, v))
        o = F.scaled_dot_product_attention(qc, kk, vv, is_causal=True, scale=head_dim**-0.5)
        ref[starts[c] - row0:starts[c] - row0 + n] = o.transpose(0, 1)
    out = torch.ops.tokenloom_amx.causal_prefill_attention(q, k_cache, v_cache, tables, starts, lens, row0,
                                                           head_dim**-0.5)
    assert out.shape == ref.shape and out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert torch.allclose(out.float(), ref, atol=2e-2, rtol=0)
