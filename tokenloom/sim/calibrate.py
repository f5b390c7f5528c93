"""Calibration: the step-time model fitted to *this engine on this machine*, cached.

`estimate.CostModel` times a step from datasheet (or microbenchmark) rates -- the right
shape for a GPU running fused kernels.  To predict what `tokenloom serve` really does on
`--hardware local`, the simulator instead uses rates our forward pass actually reaches,
fitted to its real steps.  The pieces, one module each:

- `sim.step_features`   a step's work (GEMM bytes/FLOPs, padded attention, KV traffic)
- `sim.engine_cost`     the step-time formula, `Calibration` (its rates) and `EngineCostModel`
- `sim.fit`             fitting the rates to measured steps
- `sim.calibration_plan` the fixed plan of requests the real engine runs (served or offline), and
                        `MeasureEngine`, the run's signature
- here                  the cache, and `calibrate` / `calibrated_cost_model` which tie them together

The run on the real engine needs the server and the benchmarks' client, which stand above
the simulator: the command that calibrates passes it in (`measure`, the `tokenloom` command
hands every subcommand `tokenloom.entrypoints.calibration_run.run_calibration` as
`args.measure_engine`).  A cached calibration needs no run.

The result -- fitted rates, their ratio to the microbenchmarks, the fit's error and the
raw step samples -- is cached as JSON next to the microbenchmark cache, keyed by the
machine (CPU, threads, torch), the model's shape, the dtype, the block size and a hash
of the engine's hot-path source files, so editing the engine invalidates it.

    from tokenloom.entrypoints.calibration_run import run_calibration
    cm = calibrated_cost_model("/tmp/m/qwen2.5-0.5b", measure=run_calibration)  # measures once (minutes), then cached
    Simulator(cm, SimConfig(...)).run(requests)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

from tokenloom.sim.calibration_plan import MeasureEngine, engine_decode_reads_blocks_in_place
from tokenloom.sim.engine_cost import Calibration, EngineCostModel
from tokenloom.sim.fit import fit
from tokenloom.sim.step_features import StepFeatures
from tokenloom.specs.model_spec import ModelSpec, load_model_spec, normalize_dtype

CALIBRATION_VERSION = 3  # 3: busy neighbours decode-heavy (entrypoints/calibration_run.py `_BusyNeighbors`)
_CACHE_FILE = "calibration.json"

# The engine's step: the sources in these packages decide how long it takes.  Their hash is
# part of the cache key, so a calibration never outlives the code it measured.
_HOT_PATH = ("core", "engine", "model", "runner", "entrypoints/openai", "kernels")


def engine_fingerprint() -> str:
    """Hash of the engine's hot-path source: a changed engine needs a new calibration."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    for pkg in _HOT_PATH:
        for p in sorted([*(root / pkg).glob("*.py"), *(root / pkg).glob("*.cpp"), *(root / pkg).glob("*.h")]):
            h.update(f"{pkg}/{p.name}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def model_fingerprint(spec: ModelSpec) -> str:
    d = spec.to_dict()
    d.pop("name", None)
    d.pop("torch_dtype", None)
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def calibration_key(spec: ModelSpec, dtype: str, block_size: int, mode: str = "serve",
                    num_threads: int | None = None, replicas: int = 1) -> str:
    """`num_threads`: the engine's torch threads when set apart from this process's (one
    data-parallel replica's share of the cores); `replicas`: engines sharing the machine.
    Both are part of the key, as they set the step time."""
    from tokenloom.specs import microbench

    threads = (f"|engine_threads={num_threads}" if num_threads else "") + (f"|replicas={replicas}" if replicas > 1 else "")
    return (f"{microbench.cache_key()}|model={model_fingerprint(spec)}|dtype={dtype}|block={block_size}"
            f"|mode={mode}{threads}|engine={engine_fingerprint()}|v{CALIBRATION_VERSION}")


def _cache_path() -> Path:
    from tokenloom.specs import microbench

    return microbench.cache_dir() / _CACHE_FILE


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) else {}


def _write_cache(key: str, cal: Calibration) -> None:
    path = _cache_path()
    entries = _read_cache()
    entries[key] = cal.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": CALIBRATION_VERSION, "entries": entries}, indent=1), encoding="utf-8")
    os.replace(tmp, path)  # readers never see half a file


def resolve_dtype(spec: ModelSpec, dtype: str | None) -> str:
    return normalize_dtype(dtype) if dtype and dtype != "auto" else spec.default_dtype()


def calibrate(model: str, dtype: str | None = "auto", *, block_size: int = 16, mode: str = "serve",
              num_threads: int | None = None, replicas: int = 1, refresh: bool = False,
              log: Callable[[str], None] | None = None, measure: MeasureEngine | None = None) -> Calibration:
    """The cached calibration for `model` (a directory with weights) on this machine; measures if needed.

    `mode`: "serve" to predict `tokenloom serve` / `bench serve`, "offline" for in-process
    `LLM` runs (`bench throughput`, `bench sweep --mode offline`); see `MeasureEngine`.
    `num_threads`: the engine's torch threads (default: torch's), e.g. one replica's share;
    `replicas`: engines on this machine (the others run as busy neighbors while it measures).
    `measure`: what runs the engine when nothing is cached (or `refresh`); without it, a
    missing calibration is a ValueError."""
    from tokenloom.specs.hardware import local_hardware

    log = log or (lambda s: None)
    spec = load_model_spec(model)
    dt = resolve_dtype(spec, dtype)
    key = calibration_key(spec, dt, block_size, mode, num_threads, replicas)
    if not refresh:
        cached = _read_cache().get(key)
        if cached is not None:
            return Calibration.from_dict(cached)
    if not Path(model).is_dir():
        raise ValueError(f"calibrating needs the model's weights: {model!r} is not a model directory "
                         f"(make one with `tokenloom make-model --preset NAME --out DIR`)")
    if measure is None:
        raise ValueError(f"no calibration of {spec.name} ({dt}, {mode} mode) is cached for this machine and engine, "
                         f"and measuring one runs the engine: calibrate with `tokenloom simulate --calibrated`")
    hw = local_hardware()
    log(f"calibrating {spec.name} ({dt}) on this machine, {mode} mode"
        + (f", {num_threads} engine thread(s)" if num_threads else "")
        + (f", beside {replicas - 1} busy replica(s)" if replicas > 1 else "")
        + ": running the engine over a fixed plan of step shapes...")
    t0 = time.perf_counter()
    samples, gap, _ = measure(model, dt, block_size=block_size, mode=mode, num_threads=num_threads,
                      neighbors=replicas - 1, log=log)
    dispatch = hw.op_overhead_s * spec.eager_ops_per_step  # measured per-op cost x ops per forward
    paged = engine_decode_reads_blocks_in_place()
    cal = fit(samples, StepFeatures(spec, dt, block_size, paged), bandwidth_ref=hw.mem_bandwidth,
              flop_rate_ref=hw.flops_for(dt), dispatch_s=dispatch)
    cal = dataclasses.replace(cal, paged_decode=paged, step_gap_s=gap, key=key, model=spec.name, dtype=dt, mode=mode,
                   measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   calibration_wall_s=time.perf_counter() - t0,
                   samples=[{"entries": [list(e) for e in entries], "period_s": t, "forward_s": f}
                            for entries, t, f in samples])
    _write_cache(key, cal)
    return cal


def calibrated_cost_model(model: str, dtype: str | None = "auto", *, block_size: int = 16, mode: str = "serve",
                          num_threads: int | None = None, replicas: int = 1, refresh: bool = False,
                          log: Callable[[str], None] | None = None,
                          measure: MeasureEngine | None = None) -> EngineCostModel:
    """`EngineCostModel` for `model` on `--hardware local` (calibrating once with `measure`, then cached)."""
    from tokenloom.specs.hardware import local_hardware

    cal = calibrate(model, dtype, block_size=block_size, mode=mode, num_threads=num_threads, replicas=replicas,
                    refresh=refresh, log=log, measure=measure)
    spec = load_model_spec(model)
    return EngineCostModel(spec, local_hardware(), resolve_dtype(spec, dtype), cal)
