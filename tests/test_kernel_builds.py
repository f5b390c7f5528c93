"""Our CPU kernels build wherever the CPU and toolchain allow.

The kernel tests (test_cpu_kernels.py) skip where an extension is missing, so without this a
compile error would pass the suite silently, with every fast path off."""

from __future__ import annotations

import os
import platform
import shutil

import pytest

from tokenloom.kernels import cpu as cpu_kernels

flags = cpu_kernels._cpu_flags()
has_toolchain = shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None


@pytest.mark.skipif(not has_toolchain or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs an x86 CPU and a C++ toolchain with ninja")
def test_kernels_build_where_the_cpu_has_the_instructions():
    assert cpu_kernels.load() == ({"avx2", "fma"} <= flags)
    assert cpu_kernels.avx512_enabled() == ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"} <= flags)
    assert cpu_kernels.bf16_enabled() == ({"avx512f", "avx512bw", "avx512_bf16"} <= flags)
