"""glibc's heap, set for a decode loop: the same large temporaries every step, without page faults.

A CPU decode step allocates and frees the same large tensors every step: the logits (batch
x vocab floats, 19 MB at batch 32 for Qwen2.5's 151,936 tokens), the matmul outputs, the
sampler's probabilities.  By default glibc serves an allocation above its (self-adjusting)
mmap threshold with a fresh mapping and unmaps it on free, and hands the top of its heap back
to the OS once more than its trim threshold is free, so these buffers keep coming back as
new pages that fault in one 4 KiB page at a time -- tens of milliseconds of kernel time per
step (docs/performance.md, "Why each CPU kernel is chosen"); `keep_step_buffers` raises both
thresholds so the buffers stay mapped.  glibc takes no mmap threshold above 32 MiB, and a long
prefill's temporaries are larger (2,048 tokens of Qwen2.5-0.5B's gate/up output: 40 MB in
bf16, each of 24 layers), so it also turns off serving allocations from fresh mappings
altogether: they come from the heap, whose freed space the trim threshold keeps.

Both calls are no-ops off glibc; `TOKENLOOM_GLIBC_HEAP=0` leaves glibc's defaults.
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys

M_TRIM_THRESHOLD = -1  # mallopt parameter numbers, from glibc's malloc.h
M_MMAP_THRESHOLD = -3
M_MMAP_MAX = -4
MMAP_THRESHOLD_MAX = 32 << 20  # the largest mmap threshold glibc accepts on 64-bit
TRIM_THRESHOLD = 256 << 20  # more than a step's heap-served temporaries, little to hold on to


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (musl has neither)
        return libc
    except (OSError, AttributeError):
        return None


def keep_step_buffers() -> bool:
    """Serve every allocation from the heap (none from a mapping of its own) and keep up to
    256 MiB of freed heap for reuse; True if glibc took the settings."""
    libc = _libc()
    if libc is None or os.environ.get("TOKENLOOM_GLIBC_HEAP", "1") == "0":
        return False
    return all(libc.mallopt(param, value) for param, value in
               ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_MAX), (M_MMAP_MAX, 0), (M_TRIM_THRESHOLD, TRIM_THRESHOLD)))


def release_free_memory() -> None:
    """Give freed heap pages back to the OS now.

    Loading frees as much as it keeps (each checkpoint tensor is copied, then converted or
    packed), and glibc holds freed chunks for reuse, so without this the process stays
    ~0.2 GiB larger than its live data for its whole life."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)
