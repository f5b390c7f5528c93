"""Our CPU kernels build wherever the CPU and toolchain allow.

The kernel tests (test_cpu_kernels.py) skip where an extension is missing, so without this a
compile error would pass the suite silently, with every fast path off."""

from __future__ import annotations

import os
import platform
import shutil
import ctypes

from pathlib import Path

import pytest

from tokenloom.kernels import build as kernel_build
from tokenloom.kernels import cpu as cpu_kernels

flags = cpu_kernels._cpu_flags()
has_toolchain = shutil.which(os.environ.get("CXX", "c++")) is not None and shutil.which("ninja") is not None


@pytest.mark.skipif(not has_toolchain or platform.machine() not in ("x86_64", "AMD64"),
                    reason="needs an x86 CPU and a C++ toolchain with ninja")
def test_kernels_build_where_the_cpu_has_the_instructions():
    assert cpu_kernels.load() == ({"avx2", "fma"} <= flags)
    assert cpu_kernels.avx512_enabled() == ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl"} <= flags)
    assert cpu_kernels.bf16_enabled() == ({"avx512f", "avx512bw", "avx512_bf16"} <= flags)


def _copy_sources(dst):
    dst.mkdir()
    src = Path(kernel_build.__file__).parent
    for f in ("cpu_gemm.cpp", "panel_linear.h"):
        shutil.copyfile(src / f, dst / f)
    return kernel_build._with_local_headers([dst / "cpu_gemm.cpp"])


def test_build_key_follows_sources_headers_flags_and_torch(tmp_path, monkeypatch):
    a = _copy_sources(tmp_path / "checkout_a")
    b = _copy_sources(tmp_path / "checkout_b")
    assert [f.name for f in a] == ["cpu_gemm.cpp", "panel_linear.h"]
    key = kernel_build.build_key(a, ["-O3", "-mavx2"])
    assert kernel_build.build_key(b, ["-O3", "-mavx2"]) == key  # identical sources elsewhere share one build
    assert kernel_build.build_key(a, ["-O3", "-mavx512f"]) != key
    (tmp_path / "checkout_b" / "panel_linear.h").write_bytes(b"// edited\n" + (tmp_path / "checkout_b" / "panel_linear.h").read_bytes())
    assert kernel_build.build_key(b, ["-O3", "-mavx2"]) != key  # a header edit is a new build
    monkeypatch.setattr(kernel_build.torch, "__version__", "0.0.0+other")
    assert kernel_build.build_key(a, ["-O3", "-mavx2"]) != key


_TINY = r'''
#include "tiny.h"
extern "C" int tokenloom_tiny_kernel() { return TINY_VALUE; }
'''

def _tiny_sources(tmp_path, monkeypatch, value: int):
    """tiny.cpp + tiny.h (returning `value`) under tmp_path/src, and a private kernel cache."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "tiny.cpp").write_text(_TINY)
    (src / "tiny.h").write_text(f"#define TINY_VALUE {value}\n")
    cache = tmp_path / "cache"
    monkeypatch.setenv("TOKENLOOM_KERNEL_CACHE", str(cache))
    return src, cache


@pytest.mark.skipif(not has_toolchain, reason="needs a C++ toolchain with ninja")
def test_a_build_is_announced_keyed_in_its_own_directory_and_reused(tmp_path, monkeypatch, capsys):
    """Build a tiny extension through the same path as our kernels, in a private cache."""
    src, cache = _tiny_sources(tmp_path, monkeypatch, 1)

    def build() -> str:
        assert kernel_build._build("tokenloom_tiny", [src / "tiny.cpp"], [])
        return capsys.readouterr().err

    first = build()
    assert "tokenloom: building CPU kernels tokenloom_tiny (tiny.cpp, tiny.h)" in first
    assert "tokenloom: built CPU kernels tokenloom_tiny" in first
    dirs = sorted(p.name for p in cache.iterdir())
    assert len(dirs) == 1 and dirs[0].startswith("tokenloom_tiny_")
    library = cache / dirs[0] / f"{dirs[0]}.so"
    assert ctypes.CDLL(str(library)).tokenloom_tiny_kernel() == 1
    assert "building" not in build()  # a finished build is loaded, not rebuilt, and says nothing
    (src / "tiny.h").write_text("#define TINY_VALUE 2\n")  # a header change is a new build beside the old
    assert "tokenloom: building CPU kernels tokenloom_tiny" in build()
    assert len(list(cache.iterdir())) == 2


@pytest.mark.timeout(300)  # the regression is a wait that never ends: fail it in minutes
@pytest.mark.skipif(not has_toolchain, reason="needs a C++ toolchain with ninja")
def test_a_build_killed_half_way_does_not_block_the_next(tmp_path, monkeypatch):
    """A process killed mid-build (Ctrl-C, a timeout) leaves torch's `lock` file behind; the
    next build must notice nobody holds it, not wait for it forever."""
    import signal
    import subprocess
    import sys
    import textwrap

    src, cache = _tiny_sources(tmp_path, monkeypatch, 3)
    # A builder that dies while it holds both locks, as a killed build does.
    script = textwrap.dedent(f"""
        import os, signal, sys
        from tokenloom.kernels import build
        def compile_and_die(name, tag, files, cflags, build_dir):
            (build_dir / "lock").write_text("")  # torch's baton, taken as its build starts
            print("holding", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        build._compile = compile_and_die
        build._build("tokenloom_tiny", [{str(src / 'tiny.cpp')!r}], [])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TOKENLOOM_KERNEL_CACHE": str(cache)})
    assert proc.returncode == -signal.SIGKILL and "holding" in proc.stdout
    (build_dir,) = cache.iterdir()
    assert (build_dir / "lock").exists()  # what a killed build leaves
    assert kernel_build._build("tokenloom_tiny", [src / "tiny.cpp"], [])  # returns: built, not waiting
    assert not (build_dir / "lock").exists()
    assert ctypes.CDLL(str(build_dir / f"{build_dir.name}.so")).tokenloom_tiny_kernel() == 3
