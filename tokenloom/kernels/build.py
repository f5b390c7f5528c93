"""Building and caching our C++ extensions: compiled once per distinct build, loaded after.

The sources are compiled with the C++ toolchain PyTorch uses for extensions, once per
distinct build: each build lives in its own directory under ~/.cache/tokenloom/kernels
(`TOKENLOOM_KERNEL_CACHE` moves it) named by a digest of its sources (headers included),
compiler flags, torch build and Python version, so checkouts and virtual environments never
rebuild each other's kernels, and one that differs never loads a stale build.  A line on
stderr says when a build starts and how long it took.  Anything that fails (no compiler,
not x86) returns False, which leaves PyTorch's kernels in charge.

This module knows nothing of the ops: `kernels/cpu.py` names which sources to build with
which instruction-set flags and wraps the ops they register.
"""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import platform
import re
import shutil
import sys
import time
from pathlib import Path

import torch

log = logging.getLogger("tokenloom.kernels.cpu")  # the name the warnings have always carried

_LOCAL_INCLUDE = re.compile(rb'^\s*#\s*include\s*"([^"]+)"', re.MULTILINE)


def _with_local_headers(sources: list[Path]) -> list[Path]:
    """The sources plus every header they include with quotes, transitively (same folder)."""
    out: list[Path] = []
    todo = list(sources)
    while todo:
        f = todo.pop(0)
        if f in out:
            continue
        out.append(f)
        for inc in _LOCAL_INCLUDE.findall(f.read_bytes()):
            h = f.parent / inc.decode()
            if h.is_file():
                todo.append(h)
    return out


def build_key(files: list[Path], cflags: list[str]) -> str:
    """Digest naming one build: file names and contents, flags, compiler, torch and Python builds."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.git_version), sys.version.split()[0], platform.machine(),
                 os.environ.get("CXX", "c++"), *cflags):
        h.update(part.encode() + b"\0")
    for f in files:
        h.update(f.name.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def cache_root() -> Path:
    """Where kernel builds live: $TOKENLOOM_KERNEL_CACHE, else the user's cache folder."""
    env = os.environ.get("TOKENLOOM_KERNEL_CACHE")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "tokenloom" / "kernels"


def _build(name: str, sources: list[str | Path], isa_flags: list[str]) -> bool:
    """Compile (once per distinct build, see the module doc) and load one extension.

    Sources are named relative to this folder (or absolute).  The build directory holds
    its own copy of them, so the compile commands are the same from any checkout and a
    finished build is loaded straight from its library, without running the toolchain."""
    cflags = ["-O3", *isa_flags, "-fno-math-errno", "-fopenmp"]
    try:
        files = _with_local_headers([Path(__file__).with_name(str(f)) if not Path(f).is_absolute() else Path(f)
                                     for f in sources])
        tag = f"{name}_{build_key(files, cflags)}"
        build_dir = cache_root() / tag
        library = build_dir / f"{tag}.so"
        if library.is_file():
            try:
                torch.ops.load_library(str(library))
                return True
            except OSError:  # half-written by a build in another process: build (waits on its lock)
                pass
        build_dir.mkdir(parents=True, exist_ok=True)
        with open(build_dir / "build.flock", "w") as held:
            # One builder at a time, under a lock the OS drops when its holder dies, so a build
            # killed half-way (Ctrl-C, a test timeout) never leaves the next process waiting.
            fcntl.flock(held, fcntl.LOCK_EX)
            if library.is_file():  # another process built it while this one waited
                try:
                    torch.ops.load_library(str(library))
                    return True
                except OSError:
                    pass
            # torch's own build lock: any left now belongs to a builder that died (we hold ours).
            (build_dir / "lock").unlink(missing_ok=True)
            _compile(name, tag, files, cflags, build_dir)
        return True
    except Exception as e:  # no toolchain, no ninja, compile error: keep the stock kernels
        log.warning("tokenloom CPU kernels %s unavailable (%s); using PyTorch's kernels", name, e)
        return False


def _compile(name: str, tag: str, files: list[Path], cflags: list[str], build_dir: Path) -> None:
    """Copy the sources into the build directory and compile and load them there (ninja)."""
    from torch.utils.cpp_extension import load as load_ext

    src_dir = build_dir / "src"
    src_dir.mkdir(parents=True, exist_ok=True)
    for f in files:
        if not (src_dir / f.name).is_file() or (src_dir / f.name).read_bytes() != f.read_bytes():
            shutil.copyfile(f, src_dir / f.name)
    print(f"tokenloom: building CPU kernels {name} ({', '.join(f.name for f in files)}) in {build_dir}; "
          f"once per build of the sources, flags and torch", file=sys.stderr, flush=True)
    start = time.perf_counter()
    load_ext(
        name=tag,
        sources=[str(src_dir / f.name) for f in files if f.suffix != ".h"],
        extra_cflags=cflags,
        build_directory=str(build_dir),
        is_python_module=False,
        verbose=False,
    )
    print(f"tokenloom: built CPU kernels {name} in {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
