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


# The instruction-set extensions our CPU kernels choose by, as /proc/cpuinfo names them.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512vbmi", "avx512_bf16",
                "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16")


def cpu_identity() -> dict[str, str]:
    """The first CPU's family, model and stepping numbers and which of `KERNEL_FLAGS` it lists
    (/proc/cpuinfo; empty where there is none).  The model name alone does not tell a figure's
    machine apart: "AMD EPYC" has been a Zen 4 (family 25) and a Zen 5 (family 26)."""
    fields: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the first processor's block
                key, _, value = line.partition(":")
                fields[key.strip()] = value.strip()
    except OSError:
        return {}
    flags = set(fields.get("flags", "").split())
    out = {k: fields[k] for k in ("cpu family", "model", "stepping") if k in fields}
    out["kernel_flags"] = " ".join(f for f in KERNEL_FLAGS if f in flags)
    return out

