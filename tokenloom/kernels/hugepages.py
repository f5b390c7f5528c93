"""Large CPU buffers in 2 MiB pages: the packed weights and the paged KV cache.

A decode step streams every weight once (the seed: each step reads the whole model), and a
batch's attention streams its requests' KV blocks.  In 4 KiB pages, Qwen2.5-0.5B's 1.98 GB
of fp32 weights are ~480,000 pages per step: a TLB miss and a page walk every 4 KiB, and
the hardware prefetchers, which do not cross a page boundary, start over at each one.
Linux backs anonymous memory with transparent huge pages (THP) where a program asks for
them (`madvise` mode, the usual default), so these buffers are mapped on their own, aligned
to 2 MiB and marked MADV_HUGEPAGE before their first write.

It pays most where bandwidth is highest (figures: docs/performance.md, "Why each CPU kernel
is chosen").

Where THP is off, on other OSes, or with `TOKENLOOM_HUGEPAGES=0`, these are plain
`torch.empty` / `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

HUGE_PAGE = 2 << 20


def enabled() -> bool:
    return os.environ.get("TOKENLOOM_HUGEPAGES", "1") != "0" and hasattr(mmap, "MADV_HUGEPAGE")


def empty(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.empty`; on CPU, with its whole 2 MiB runs huge-page backed."""
    t = _mapped(shape, dtype) if torch.device(device).type == "cpu" else None
    return torch.empty(shape, dtype=dtype, device=device) if t is None else t


def zeros(shape: int | tuple[int, ...], dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """`torch.zeros`, the same way.  Written through now, like torch.zeros, although a fresh
    mapping already reads as zeros: every page is faulted in here, at start-up, instead of
    the first time a decode step writes a KV block there (the kernel zeroes a 2 MiB page on
    its first touch, which would land inside somebody's step)."""
    t = _mapped(shape, dtype) if torch.device(device).type == "cpu" else None
    return torch.zeros(shape, dtype=dtype, device=device) if t is None else t.zero_()


def _mapped(shape: int | tuple[int, ...], dtype: torch.dtype) -> torch.Tensor | None:
    """A tensor in its own anonymous mapping, aligned to 2 MiB and marked MADV_HUGEPAGE, or
    None where that does not apply (small, THP unavailable, turned off).  The tail past the
    last whole 2 MiB stays in small pages, so no huge page is left half used."""
    shape = (shape,) if isinstance(shape, int) else tuple(shape)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if nbytes < HUGE_PAGE or not enabled():
        return None
    # One extra 2 MiB of address space to align in; it is never touched, so never resident.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps `region` mapped while the tensor lives
    start = -raw.data_ptr() % HUGE_PAGE
    try:
        region.madvise(mmap.MADV_HUGEPAGE, start, nbytes // HUGE_PAGE * HUGE_PAGE)
    except OSError:  # a kernel built without THP: small pages, same tensor
        pass
    return raw[start : start + nbytes].view(dtype).view(shape)
