"""The decode loop's large temporaries come from glibc's heap, not from fresh mappings
(kernels/glibc_heap.py), so they are not faulted in anew every step."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenloom.kernels import glibc_heap

PROBE = """
import sys, torch
from tokenloom.kernels import glibc_heap
if sys.argv[1] == "1":
    assert glibc_heap.keep_step_buffers()
# 30 MiB of float32: a batch-48 logits tensor for a 151,936-token vocabulary; 40 MiB of bf16:
# a 2,048-token prefill's gate/up output for Qwen2.5-0.5B, above glibc's largest mmap threshold
t = torch.empty(int(sys.argv[2]) << 20, dtype=torch.uint8)
for line in open("/proc/self/maps"):
    lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
    if lo <= t.data_ptr() < hi:
        print("heap" if line.rstrip().endswith("[heap]") else "own mapping")
"""


@pytest.mark.skipif(glibc_heap._libc() is None, reason="needs glibc")
def test_step_sized_allocations_come_from_the_heap_only_when_asked():
    def where(keep: str, mib: int) -> str:
        env = {**os.environ, "TOKENLOOM_GLIBC_HEAP": "1"}
        return subprocess.run([sys.executable, "-c", PROBE, keep, str(mib)], capture_output=True, text=True,
                              check=True, env=env).stdout.strip()

    for mib in (30, 40):
        assert where("0", mib) == "own mapping"  # glibc's default: a fresh mmap, unmapped on free
        assert where("1", mib) == "heap"
