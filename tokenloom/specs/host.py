"""The machine this process runs on, as the benchmarks and the microbenchmarks name it.

Pure Python (no torch): `bench` reports record the CPU model without importing torch,
and `specs.microbench` keys its cache by it.
"""

from __future__ import annotations

import platform


def cpu_model_name() -> str:
    """This machine's CPU model name (from /proc/cpuinfo where there is one)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown-cpu"
