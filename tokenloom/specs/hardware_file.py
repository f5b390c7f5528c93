"""Hardware as data: GPUs described in a file, or a catalog GPU with figures passed by hand.

The catalog (`specs.hardware`) holds datasheet GPUs.  A planner with a part that is not in
it -- or a measured bandwidth for one that is -- describes it in a TOML or JSON file::

    [[gpu]]
    name = "my-a100"
    memory_gib = 80
    bandwidth_gbs = 1935            # decimal GB/s, as datasheets print it
    peak_tflops = { float16 = 312, bfloat16 = 312, float32 = 19.5, int8 = 624 }
    interconnect = "pcie"           # nvlink | pcie | infinity-fabric
    link_bandwidth_gbs = 32         # per direction, per GPU
    source = "where the figures come from"

(a JSON file is a list of such objects, or {"gpu": [...]}) and passes `--hardware-file
FILE --hardware my-a100`; or overrides single figures with `--bandwidth 1.7e12`,
`--peak-flops 250e12`, `--memory 80GiB`.  Overridden figures are named in the source.
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import replace
from pathlib import Path

from tokenloom.specs.hardware import CATALOG, GB, GiB, TFLOPS, Hardware, UnknownHardwareError, get_hardware

_INTERCONNECTS = ("nvlink", "pcie", "infinity-fabric")
_KEYS = {"name", "memory_gib", "bandwidth_gbs", "peak_tflops", "interconnect", "link_bandwidth_gbs", "source",
         "description"}


def _gpu_from_dict(d: dict, where: str) -> Hardware:
    unknown = set(d) - _KEYS
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(_KEYS))}")
    try:
        name = str(d["name"]).strip().lower()
        peaks = {str(k): float(v) * TFLOPS for k, v in dict(d["peak_tflops"]).items()}
        hw = Hardware(
            name=name,
            memory_bytes=int(float(d["memory_gib"]) * GiB),
            mem_bandwidth=float(d["bandwidth_gbs"]) * GB,
            peak_flops=peaks,
            source=str(d.get("source", f"hardware file {where}")),
            description=str(d.get("description", name)),
            interconnect=str(d.get("interconnect", "pcie")),
            link_bandwidth=float(d.get("link_bandwidth_gbs", 32)) * GB,
        )
    except KeyError as e:
        raise ValueError(f"{where}: a GPU lacks {e.args[0]!r} (needs name, memory_gib, bandwidth_gbs, "
                         f"peak_tflops)") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{where}: {e}") from None
    if "float16" not in peaks:
        raise ValueError(f"{where}: {name}: peak_tflops needs at least float16")
    peaks.setdefault("bfloat16", peaks["float16"])
    peaks.setdefault("float32", peaks["float16"] / 4)
    if hw.interconnect not in _INTERCONNECTS:
        raise ValueError(f"{where}: {name}: interconnect must be one of {', '.join(_INTERCONNECTS)}")
    if hw.mem_bandwidth <= 0 or hw.memory_bytes <= 0 or any(v <= 0 for v in peaks.values()):
        raise ValueError(f"{where}: {name}: memory, bandwidth and peaks must be > 0")
    return hw


def load_hardware_file(path: str | Path) -> dict[str, Hardware]:
    """The GPUs a TOML or JSON hardware file describes, by name."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"--hardware-file {path}: {e.strerror or e}") from None
    try:
        data = json.loads(text) if p.suffix.lower() == ".json" else tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as e:
        raise ValueError(f"--hardware-file {path}: {e}") from None
    items = data.get("gpu", []) if isinstance(data, dict) else data
    if not isinstance(items, list) or not items:
        raise ValueError(f"--hardware-file {path}: expected a list of GPUs ([[gpu]] tables in TOML)")
    gpus = [_gpu_from_dict(d, f"{path} gpu {i}") for i, d in enumerate(items)]
    return {g.name: g for g in gpus}


def parse_size(text: str | float | int) -> int:
    """'80GiB', '24GB', '1e9' -> bytes."""
    if isinstance(text, (int, float)):
        return int(text)
    t = str(text).strip()
    for suffix, scale in (("gib", GiB), ("gb", GB), ("mib", 2**20), ("mb", 10**6)):
        if t.lower().endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))


def with_overrides(hw: Hardware, *, bandwidth: float | None = None, peak_flops: float | None = None,
                   memory: str | int | None = None) -> Hardware:
    """`hw` with figures passed by hand: bandwidth in B/s, the 16-bit peak in FLOP/s (fp32 and
    the 8-bit peaks scale with it), memory in bytes or with a unit."""
    if bandwidth is None and peak_flops is None and memory is None:
        return hw
    notes = []
    changes: dict = {}
    if bandwidth is not None:
        if bandwidth <= 0:
            raise ValueError("--bandwidth must be > 0 (bytes/s)")
        changes["mem_bandwidth"] = float(bandwidth)
        notes.append(f"bandwidth {bandwidth / 1e9:g} GB/s")
    if peak_flops is not None:
        if peak_flops <= 0:
            raise ValueError("--peak-flops must be > 0 (FLOP/s, 16-bit dense)")
        scale = float(peak_flops) / hw.peak_flops["float16"]
        changes["peak_flops"] = {k: v * scale for k, v in hw.peak_flops.items()}
        notes.append(f"16-bit peak {peak_flops / 1e12:g} TFLOP/s")
    if memory is not None:
        nbytes = parse_size(memory)
        if nbytes <= 0:
            raise ValueError("--memory must be > 0")
        changes["memory_bytes"] = nbytes
        notes.append(f"memory {nbytes / GiB:g} GiB")
    return replace(hw, source=f"{hw.source}; by hand: {', '.join(notes)}", **changes)


def resolve_hardware(name: str, *, hardware_file: str | None = None, bandwidth: float | None = None,
                     peak_flops: float | None = None, memory: str | int | None = None,
                     refresh_local: bool = False) -> Hardware:
    """`--hardware NAME` looked up in `--hardware-file` first, then the catalog (or `local`), with overrides."""
    hw: Hardware | None = None
    if hardware_file:
        gpus = load_hardware_file(hardware_file)
        hw = gpus.get(name.strip().lower())
        if hw is None and name.strip().lower() not in CATALOG and name.strip().lower() != "local":
            raise UnknownHardwareError(f"unknown hardware {name!r}; {hardware_file} describes "
                                       f"{', '.join(sorted(gpus))}")
    if hw is None:
        hw = get_hardware(name, refresh_local=refresh_local)
    return with_overrides(hw, bandwidth=bandwidth, peak_flops=peak_flops, memory=memory)
