"""Triton kernels for the GPU path (paged attention, KV writes, fused small ops).

The same kernels run on CPU tensors under `TRITON_INTERPRET=1`, which is how CI tests them
without a GPU.  This package imports nothing else of tokenloom's (the kernels are the
ground floor); `available()` says whether Triton can run here at all.
"""

from __future__ import annotations

import functools
import os


@functools.cache
def available() -> bool:
    """True where `import triton` works (a GPU build, or any build under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU, one program at a time (tests)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def decode_num_splits(num_seqs: int, num_kv_heads: int, num_sms: int, max_splits: int = 16) -> int:
    """How many context slices split-KV decode gives each (request, KV head): enough that
    about two programs run per SM, at most `max_splits` (then one slice: no merge)."""
    want = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    return max(1, min(max_splits, want))
