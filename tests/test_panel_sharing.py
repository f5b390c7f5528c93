"""Decode GEMMs share their weight panels among the threads as they finish
(kernels/gemm_driver.h `for_panel_pieces`): a thread done with its own run takes panels from the
back of another's.  Which thread computes a panel then changes from call to call, so the result
must not depend on it: every path that shares, at every thread count (more threads than this
machine's cores make the operating system's turns uneven, so runs are taken over), gives the
one-thread call's output bit for bit, and every panel is computed exactly once (a panel skipped
would leave `empty`'s memory, one computed twice with accumulation would double)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tokenloom.kernels import amx, amx_probe
from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.model.weights.quantization import PanelQuantized, parse_scheme

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="needs an x86 CPU with AVX2+FMA and a C++ toolchain")

# 303 panels of 32 columns and a ragged last one: runs that do not split evenly, pieces of
# several panels, pairs of panels with an odd one at the end
N, K = 303 * 32 + 7, 192
THREADS = (1, 2, 3, 4)


def _amx_usable() -> bool:
    return (amx_probe.FLAGS <= cpu_kernels._cpu_flags() and cpu_kernels.bf16_enabled() and amx.build()
            and amx_probe.amx_usable())


def _paths() -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], tuple[int, ...]]]:
    """name -> (x -> y, the row counts at which that path shares its panels)."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(N, K, generator=g)
    bias = cpu_kernels.pad_bias(torch.randn(N, generator=g), N)
    paths = {"avx2 fp32": (lambda x, p=cpu_kernels.pack(w): torch.ops.tokenloom_cpu.linear(x, p, N, bias), (1, 3))}
    if cpu_kernels.avx512_enabled():
        wide = cpu_kernels.pack(w, cpu_kernels.WIDE)
        paths["avx512 fp32"] = (lambda x: torch.ops.tokenloom_avx512.linear(x, wide, N, bias), (1, 4))
    if cpu_kernels.bf16_enabled():
        pairs = cpu_kernels.pack_pairs(w.bfloat16())  # the AMX path below reads the same panels
        paths["avx512 bf16"] = (lambda x: torch.ops.tokenloom_bf16.linear(x.bfloat16(), pairs, N, bias), (1, 4))
    if cpu_kernels.quant_ops() is not None:
        for name in ("int8", "int4"):
            q = PanelQuantized(w, parse_scheme(name))
            paths[f"{name} decode"] = (lambda x, q=q: q.matmul(x.bfloat16(), bias), (1, 5, 8))
    if _amx_usable():
        paths["amx bf16"] = (lambda x: torch.ops.tokenloom_amx.linear_bf16(x.bfloat16(), pairs, N, bias), (16, 24, 40))
        q8 = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
        quads, scales = cpu_kernels.pack_int8(q8, torch.rand(N, generator=g) + 0.01, quads=True)
        paths["amx int8 limbs"] = (
            lambda x: torch.ops.tokenloom_amx.linear_int8_limbs(x.bfloat16(), quads, scales, N, bias), (9, 16, 24))
    return paths


PATHS = _paths()


@pytest.mark.parametrize("name", sorted(PATHS))
def test_a_call_gives_the_one_thread_result_however_its_panels_are_shared(name: str) -> None:
    fn, rows = PATHS[name]
    g = torch.Generator().manual_seed(11)
    before = torch.get_num_threads()
    try:
        for m in rows:
            x = torch.randn(m, K, generator=g)
            torch.set_num_threads(1)
            one = fn(x)
            assert torch.isfinite(one.float()).all()
            for threads in THREADS[1:]:
                torch.set_num_threads(threads)
                for _ in range(3):  # who takes which panel differs from call to call
                    assert torch.equal(fn(x), one), (m, threads)
    finally:
        torch.set_num_threads(before)
