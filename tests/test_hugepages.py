"""Weights and KV cache in 2 MiB pages (kernels/hugepages.py): same tensors, huge-page backed
where the kernel offers transparent huge pages, and unmapped when dropped."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

from tokenloom.kernels import cpu as cpu_kernels
from tokenloom.kernels import hugepages

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
thp_offered = THP.exists() and ("[always]" in THP.read_text() or "[madvise]" in THP.read_text())


def _mapping(ptr: int) -> dict[str, int] | None:
    """/proc/self/smaps fields (kB) of the mapping holding address `ptr`, or None."""
    found, fields = False, {}
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            if found:
                break
            lo, hi = (int(v, 16) for v in head.split("-"))
            found = lo <= ptr < hi
        elif found and line.split()[-1] == "kB":
            fields[head.rstrip(":")] = int(line.split()[1])
    return fields if found else None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_buffers_are_aligned_writable_tensors(dtype):
    t = hugepages.empty((3, 1000, 1000), dtype)
    assert t.shape == (3, 1000, 1000) and t.dtype == dtype and t.is_contiguous()
    if hugepages.enabled():
        assert t.data_ptr() % hugepages.HUGE_PAGE == 0
    t.copy_(torch.arange(3e6).view(3, 1000, 1000))
    assert torch.equal(t[2, 999], torch.arange(2999000, 3e6).to(dtype))
    z = hugepages.zeros((3, 1000, 1000), dtype)
    assert not z.any()


def test_small_buffers_and_the_switch_give_plain_tensors(monkeypatch):
    assert hugepages._mapped((100, 100), torch.float32) is None  # under 2 MiB: not worth a mapping
    monkeypatch.setenv("TOKENLOOM_HUGEPAGES", "0")
    assert hugepages._mapped((4096, 4096), torch.float32) is None
    assert not hugepages.zeros((4096, 4096), torch.float32).any()


@pytest.mark.skipif(not (thp_offered and hugepages.enabled()), reason="needs Linux transparent huge pages")
def test_buffers_are_backed_by_huge_pages_and_unmapped_when_dropped():
    t = hugepages.zeros((16 << 20) // 4 + 123, torch.float32)  # 16 MiB and a ragged tail
    t.fill_(1.0)  # first writes fault the pages in
    m = _mapping(t.data_ptr())
    assert m is not None and m["AnonHugePages"] >= 8 * 1024, m  # most of the 8 whole huge pages
    assert m["AnonHugePages"] <= 16 * 1024  # the tail stays in small pages
    ptr = t.data_ptr()
    del t
    gc.collect()
    assert _mapping(ptr) is None


@pytest.mark.skipif(not cpu_kernels.load(), reason="needs an x86 CPU with AVX2+FMA and a C++ toolchain")
def test_packed_weights_live_in_huge_pages_and_multiply_correctly():
    w = torch.randn(1000, 1024, generator=torch.Generator().manual_seed(0))  # 4 MB: two whole huge pages
    packed = cpu_kernels.pack(w)
    if hugepages.enabled():
        assert packed.data_ptr() % hugepages.HUGE_PAGE == 0
    x = torch.randn(5, 1024, generator=torch.Generator().manual_seed(1))
    y = cpu_kernels.linear_op(packed)(x, packed, 1000, None)
    torch.testing.assert_close(y, x @ w.T, rtol=1e-4, atol=1e-4)
