"""Our quantized kernel on weights that arrive quantized (GGUF's Q4_0 / Q8_0 / Q4_K blocks):
int4 with float16 or float32 group scales, and int8 in groups of 32 with float16 (or bfloat16)
scales.

Each build of the kernel (AVX2 with F16C, AVX-512, AVX-512 with VNNI's integer path) multiplies
by exactly the matrix `TorchQuantized.from_quantized` dequantizes -- the file's integers times
its scales, never rounded again -- at decode's row counts and at prefill's, reads the same
rows back for a tied embedding, and keeps each row of an integer-path call independent of the
rows beside it.  The float16 scales really are float16: a scale bfloat16 cannot hold survives.
"""

from __future__ import annotations

import math

import pytest
import torch
from test_quantization import kernel_build  # noqa: F401 (the fixture: each build in turn)

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.weights.quant_schemes import QuantScheme
from tokenloom.model.weights.quantization import PanelQuantized, TorchQuantized

SCHEMES = {"int4-fp16": (QuantScheme("q4_0", 4, 32), torch.float16),
           "int4-fp32": (QuantScheme("q4_k", 4, 32), torch.float32),
           "int8-g32-fp16": (QuantScheme("q8_0", 8, 32), torch.float16),
           "int8-g32-bf16": (QuantScheme("q8_0", 8, 32), torch.bfloat16)}


def _blocks(name: str, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Integers and scales as a file holds them: q in the type's range, one scale per 32."""
    scheme, dtype = SCHEMES[name]
    g = torch.Generator().manual_seed(seed)
    lo, hi = (-8, 8) if scheme.bits == 4 else (-127, 128)
    q = torch.randint(lo, hi, (n, k), generator=g, dtype=torch.int8)
    s = ((torch.rand(n, k // 32, generator=g) - 0.3) * 0.02).to(dtype)  # some negative, as GGUF's d can be
    if dtype == torch.float32:  # Q4_K's sub-block scales: a float16 times a 6-bit integer
        s = s.half().float() * torch.randint(0, 64, s.shape, generator=g).float()
    s[0, 0] = 0  # an all-zero block
    return q, s


@pytest.mark.parametrize("name", sorted(SCHEMES))
@pytest.mark.parametrize("n,k", [(70, 96), (64, 256), (33, 512)])
def test_kernel_multiplies_by_the_blocks_values(kernel_build, name, n, k):  # noqa: F811
    q, s = _blocks(name, n, k, n * k)
    scheme = SCHEMES[name][0]
    ours, generic = PanelQuantized.from_quantized(q, s, scheme, k), TorchQuantized.from_quantized(q, s, scheme, k)
    deq = generic.dequantize()
    assert torch.equal(deq, q.float() * s.float().repeat_interleave(32, dim=1))  # unrounded
    assert torch.equal(ours.dequantize(), deq)
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(n, generator=g)
    padded = torch.nn.functional.pad(bias, (0, ours.qweight.shape[0] * 32 - n))
    for m in (1, 3, 5, 8, 32, 100):
        x = torch.randn(m, k, generator=g)
        ref = (x.double() @ deq.double().t() + bias.double()).float()
        tol = 2e-5 * math.sqrt(k) * x.abs().max().item() * deq.abs().max().item()
        torch.testing.assert_close(ours.matmul(x, padded), ref, atol=tol, rtol=0)
        torch.testing.assert_close(generic.matmul(x, bias), ref, atol=tol, rtol=0)
    xb = torch.randn(2, 5, k, generator=g).bfloat16()
    y = ours.matmul(xb, None)
    assert y.shape == (2, 5, n) and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, generic.matmul(xb, None), atol=1e-2 * deq.abs().max().item() * math.sqrt(k),
                               rtol=1e-2)
    ids = torch.tensor([[0, 31, 32], [n - 1, 5, 16]])
    assert torch.equal(ours.rows(ids), generic.rows(ids))


@pytest.mark.parametrize("name", ["int4-fp16", "int8-g32-fp16", "int4-fp32"])
def test_scales_are_not_rounded_to_a_narrower_type(kernel_build, name):  # noqa: F811
    """A scale with more mantissa bits than bfloat16 (float16) or than float16 (float32, as a
    Q4_K sub-block's d * sc is) holds: the kernel's product is the exact one, 2^-10 (2^-14) apart
    from what the narrower scale would give."""
    scheme, dtype = SCHEMES[name]
    scale = 1 + 2**-10 if dtype == torch.float16 else 1 + 2**-14  # float16 rounds 1 + 2^-14 to 1
    q = torch.full((32, 64), 3, dtype=torch.int8)
    s = torch.full((32, 2), scale, dtype=dtype)
    ours = PanelQuantized.from_quantized(q, s, scheme, 64)
    y = ours.matmul(torch.ones(1, 64), None)
    assert torch.equal(y, torch.full((1, 32), 64 * 3 * scale))


@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_integer_path_rows_do_not_depend_on_the_rows_beside_them(kernel_build, name):  # noqa: F811
    if cpu_kernels.quant_ops() is not getattr(torch.ops, "tokenloom_q512v", None):
        pytest.skip("the integer path is the VNNI build's")
    q, s = _blocks(name, 80, 320, 13)
    ours = PanelQuantized.from_quantized(q, s, SCHEMES[name][0], 320)
    x = torch.randn(8, 320, generator=torch.Generator().manual_seed(2))
    one = torch.cat([ours.matmul(x[i:i + 1], None) for i in range(8)])
    for m in range(2, 9):
        assert torch.equal(ours.matmul(x[:m], None), one[:m]), m


def test_grouped_int8_counts_its_scales():
    q8 = QuantScheme("q8_0", 8, 32)
    assert q8.matrix_bytes(10, 64) == 10 * 2 * (32 + 2)  # GGUF's 34-byte Q8_0 block
    assert QuantScheme("q4_0", 4, 32).matrix_bytes(10, 64) == 10 * 2 * 18  # and its 18-byte Q4_0 block


def test_int4_panels_from_gguf_nibble_blocks_are_the_panels_of_the_same_values():
    """`pack_int4_blocks` (GGUF's Q4_0 nibbles straight into our panels) against `pack_int4` of
    the same integers, rows that fill no whole panel included."""
    for n in (64, 70):
        b = torch.randint(0, 256, (n, 3, 16), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
        q = (torch.cat([b & 15, b >> 4], dim=-1).to(torch.int8) - 8).view(n, 96)  # byte j: j low, j + 16 high
        want, _ = cpu_kernels.pack_int4(q, torch.ones(n, 3, dtype=torch.float16))
        assert torch.equal(cpu_kernels.pack_int4_blocks(b), want)


@pytest.mark.parametrize("n,k", [(70, 256), (33, 512)])
def test_int4_group_offsets_are_added_by_the_kernel(kernel_build, n, k):  # noqa: F811
    """GGUF's Q4_K as we hold it: w = (q - 8 as stored) * s + o per group of 32, float32 s and o;
    the kernel adds o times each group's sum of x on every path (integer and float32, fused and
    dequantized-block rows), and `rows` gives w back for a tied lookup."""
    q, s = _blocks("int4-fp32", n, k, n + k)
    g = torch.Generator().manual_seed(3)
    o = (torch.rand(n, k // 32, generator=g) - 0.5) * 0.05
    ours = PanelQuantized.from_quantized(q, s, QuantScheme("q4_k", 4, 32, group_bytes=8), k, offsets=o)
    w = q.float() * s.repeat_interleave(32, dim=1) + o.repeat_interleave(32, dim=1)
    assert torch.equal(ours.dequantize(), w)
    for m in (1, 3, 5, 8, 16, 40):
        x = torch.randn(m, k, generator=g)
        ref = (x.double() @ w.double().t()).float()
        tol = 3e-5 * math.sqrt(k) * x.abs().max().item() * w.abs().max().item()
        torch.testing.assert_close(ours.matmul(x, None), ref, atol=tol, rtol=0)
        xb = x.bfloat16()
        refb = (xb.double() @ w.double().t()).float()
        # bf16 x: the result rounded to bfloat16 (and x on two limbs, 2^-13 of each block's largest)
        torch.testing.assert_close(ours.matmul(xb, None).float(), refb, atol=1e-2 * refb.abs().max().item(), rtol=0)
