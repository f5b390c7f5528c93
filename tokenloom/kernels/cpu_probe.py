"""What this CPU can run: the instruction-set flags the kernels are chosen and built by.

Read from /proc/cpuinfo (empty where there is none: not Linux, not x86), each time asked, so
a test may change what it reports.  `kernels/cpu.py` builds an extension only where its
flags are all present.
"""

from __future__ import annotations

from pathlib import Path


def cpu_flags() -> set[str]:
    """The CPU's feature flags ("avx2", "fma", "avx512f", "avx512_bf16", ...); empty if unknown."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
