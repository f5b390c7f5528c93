"""Validation: does the simulator predict what the real server measured?

    tokenloom bench serve --launch /tmp/m/qwen2.5-0.5b ... --output-json real.json
    tokenloom simulate --compare-with real.json

reads the `bench serve` JSON, rebuilds *the same requests* (the workload spec recorded
there regenerates them exactly -- same seed, lengths, token ids and arrival times -- or
the `--load-workload` file it replayed), runs them through the simulator with the same
engine limits (max_num_seqs, max_num_batched_tokens, max_model_len, block size, KV
blocks, chunked prefill, prefix caching, client concurrency) on `--hardware local` with
the cost model *calibrated against this engine* (`tokenloom.sim.calibrate`; measured
through the server for `bench serve`, in-process for an offline `bench sweep`), and prints
the measured and simulated figures side by side with the relative error

    error = (simulated - measured) / measured

for the four headline numbers -- median TTFT, median TPOT, P95 TPOT and output
throughput -- plus a few more for context and, for grouped workloads (mixed-long's
short/long), per group.  The calibration never sees the benchmark: it is fitted on its
own fixed plan of step shapes, so the comparison is an honest out-of-sample check of
the whole chain (step-time model + the real scheduler's queueing and batching).
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    from tokenloom.sim.calibration_plan import MeasureEngine

DEFAULT_TOLERANCE = 0.15


@dataclass(frozen=True)
class Metric:
    key: str
    label: str
    path: tuple[str, ...]  # where it lives in a summary dict (`BenchSummary.to_dict()`)
    target: bool  # one of the headline numbers the tolerance applies to


TARGET_METRICS: tuple[Metric, ...] = (
    Metric("ttft_median", "median TTFT (ms)", ("ttft_ms", "median"), True),
    Metric("tpot_median", "median TPOT (ms)", ("tpot_ms", "median"), True),
    Metric("tpot_p95", "P95 TPOT (ms)", ("tpot_ms", "p95"), True),
    Metric("output_throughput", "output throughput (tok/s)", ("output_throughput",), True),
)
CONTEXT_METRICS: tuple[Metric, ...] = (
    Metric("ttft_p95", "P95 TTFT (ms)", ("ttft_ms", "p95"), False),
    Metric("itl_median", "median ITL (ms)", ("itl_ms", "median"), False),
    Metric("e2el_median", "median E2E (ms)", ("e2el_ms", "median"), False),
    Metric("duration", "duration (s)", ("duration_s",), False),
)
GROUP_METRICS: tuple[Metric, ...] = (
    Metric("ttft_median", "median TTFT (ms)", ("ttft_ms", "median"), False),
    Metric("ttft_p95", "P95 TTFT (ms)", ("ttft_ms", "p95"), False),
    Metric("tpot_median", "median TPOT (ms)", ("tpot_ms", "median"), False),
    Metric("tpot_p95", "P95 TPOT (ms)", ("tpot_ms", "p95"), False),
)


# ---------------------------------------------------------------- the error math
def metric_value(summary: Mapping[str, Any], path: Sequence[str]) -> float:
    """A number from a summary dict; NaN when it is missing or null."""
    v: Any = summary
    for k in path:
        if not isinstance(v, Mapping) or k not in v:
            return math.nan
        v = v[k]
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else math.nan


def relative_error(measured: float, simulated: float) -> float:
    """(simulated - measured) / measured; NaN when undefined (measured 0 or either missing)."""
    if not (math.isfinite(measured) and math.isfinite(simulated)) or measured == 0:
        return math.nan
    return (simulated - measured) / measured


@dataclass(frozen=True)
class MetricComparison:
    key: str
    label: str
    measured: float
    simulated: float
    rel_error: float
    target: bool
    tolerance: float

    @property
    def ok(self) -> bool:
        """Within tolerance (an undefined error is not ok)."""
        return math.isfinite(self.rel_error) and abs(self.rel_error) <= self.tolerance

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["ok"] = self.ok
        return d


def compare(measured: Mapping[str, Any], simulated: Mapping[str, Any], *, tolerance: float = DEFAULT_TOLERANCE,
            metrics: Sequence[Metric] = TARGET_METRICS + CONTEXT_METRICS) -> list[MetricComparison]:
    """Side-by-side rows for two summary dicts (as `BenchSummary.to_dict()` writes them)."""
    rows = []
    for m in metrics:
        a, b = metric_value(measured, m.path), metric_value(simulated, m.path)
        rows.append(MetricComparison(m.key, m.label, a, b, relative_error(a, b), m.target, tolerance))
    return rows


def all_targets_ok(rows: Sequence[MetricComparison]) -> bool:
    return all(r.ok for r in rows if r.target)


# ---------------------------------------------------------------- rebuilding the run
@dataclass
class BenchInputs:
    """What the simulator needs to replay a measured run."""

    model: str
    dtype: str
    requests: list  # BenchRequest
    sim_config: Any  # SimConfig
    max_concurrency: int | None
    workload_name: str
    kv_blocks_note: str
    data_parallel_size: int = 1  # replicas behind the cache-aware router (`serve -dp N`)
    engine_threads: int | None = None  # each engine's torch threads, when set apart from torch's default


def workload_spec_from_dict(d: Mapping[str, Any]):
    """`WorkloadSpec` from its recorded `to_dict()` form."""
    from tokenloom.measure.workloads import WorkloadSpec

    kw = {k: d[k] for k in WorkloadSpec.__dataclass_fields__ if k in d}
    rate = kw.get("request_rate", math.inf)
    kw["request_rate"] = math.inf if rate in (None, "inf") else float(rate)
    return WorkloadSpec(**kw)


def rebuild_requests(doc: Mapping[str, Any]) -> list:
    """The benchmark's requests: the replayed workload file if it still exists, else regenerated
    from the recorded spec; checked against the recorded workload stats."""
    from tokenloom.measure.workloads import generate_workload, load_jsonl, workload_stats

    cfg = doc.get("config", {})
    wl = doc.get("workload") or {}
    src = cfg.get("load_workload")
    if src:
        if not Path(src).exists():
            raise ValueError(f"the benchmark replayed {src!r}, which no longer exists")
        reqs = load_jsonl(src)
    else:
        if "spec" not in wl:
            raise ValueError("the benchmark JSON records no workload spec")
        reqs = generate_workload(workload_spec_from_dict(wl["spec"]))
    want = wl.get("stats") or {}
    got = workload_stats(reqs)
    for k in ("num_requests", "total_input_tokens", "total_output_tokens"):
        if k in want and want[k] != got[k]:
            raise ValueError(f"the rebuilt workload differs from the measured one ({k}: {got[k]} vs {want[k]}); "
                             f"was it generated by another version of tokenloom?")
    return reqs


def _bench_model(doc: Mapping[str, Any]) -> str:
    cfg = doc.get("config", {})
    if doc.get("benchmark") == "sweep":
        model = cfg.get("model")
        if model is None:
            from tokenloom.bundled import BUNDLED_MODEL_DIR

            model = str(BUNDLED_MODEL_DIR)
    else:
        model = cfg.get("launch") or cfg.get("model_name")
    if not model or not Path(model).is_dir():
        raise ValueError(f"cannot find the benchmarked model directory ({model!r}); the benchmark must have run a "
                         f"local model directory (bench serve --launch DIR, bench sweep --model DIR) that still exists")
    return str(model)


def inputs_from_bench(doc: Mapping[str, Any], overrides: Mapping[str, Any] | None = None) -> BenchInputs:
    """Model, dtype, requests and engine limits of a `bench serve --launch` JSON (or of one point
    of a `bench sweep` JSON: the point's values given as `overrides`)."""
    from tokenloom.config import EngineArgs, EngineConfig
    from tokenloom.sim.calibrate import resolve_dtype
    from tokenloom.sim.simulator import SimConfig
    from tokenloom.specs.model_spec import load_model_shape, load_model_spec

    if doc.get("benchmark") not in ("serve", "sweep"):
        raise ValueError(f"--compare-with wants a `tokenloom bench serve` or `bench sweep` JSON, "
                         f"got benchmark={doc.get('benchmark')!r}")
    cfg = {**doc.get("config", {}), **(overrides or {})}
    if doc.get("benchmark") == "serve" and not cfg.get("launch"):
        raise ValueError("the benchmark ran against --base-url: the server's engine flags (max_num_seqs, "
                         "max_num_batched_tokens, ...) were not recorded; benchmark with --launch DIR and the "
                         "engine flags so the simulator can use the same ones")
    model = _bench_model(doc)
    spec = load_model_spec(model)
    dtype = resolve_dtype(spec, cfg.get("dtype") or "auto")
    # The engine flags the benchmark recorded (absent or null: the engine's default), resolved
    # exactly as the engine resolves them -- on this machine's CPU, whose free RAM is read now.
    dp = int(cfg.get("data_parallel_size") or 1)
    if dp > 1:  # each replica's threads and KV budget, exactly as `serve -dp` splits the machine
        cfg.update(replica_flags(cfg, dp))
    args = EngineArgs(**{k: v for k, v in cfg.items() if k in EngineArgs.field_names() and v is not None})
    engine = EngineConfig.resolve(args, load_model_shape(model), model=model, model_name=model, device="cpu",
                                  dtype=dtype)
    note = {"default": "engine default (re-derived now; pass --num-kv-blocks to the benchmark to pin it)"}.get(
        engine.kv_blocks_from, engine.kv_blocks_from)
    sim_cfg = SimConfig.from_engine_config(engine)
    spec_d = (doc.get("workload") or {}).get("spec") or {}
    if spec_d.get("respect_eos"):
        raise ValueError("the benchmark ran with --respect-eos: output lengths were the model's choice, "
                         "which a simulator cannot know; benchmark with fixed lengths (the default)")
    return BenchInputs(model=str(model), dtype=dtype, requests=rebuild_requests(doc), sim_config=sim_cfg,
                       # `bench sweep --mode offline` adds requests at their arrival times: no client limit.
                       max_concurrency=(cfg.get("max_concurrency") or None)
                       if doc.get("benchmark") == "serve" or cfg.get("mode") == "serve" else None,
                       workload_name=str(spec_d.get("name", "?")), kv_blocks_note=note,
                       data_parallel_size=dp, engine_threads=cfg.get("num_threads"))


def replica_flags(cfg: Mapping[str, Any], n: int) -> dict[str, Any]:
    """The engine settings one of `n` data-parallel replicas got (`specs.placement.placement`),
    as config entries: its torch threads and, unless the benchmark sized it, its KV budget."""
    from tokenloom.specs.placement import placement

    ns = argparse.Namespace(**{"device": "cpu", "num_threads": None, "kv_cache_memory": None,
                               "num_kv_blocks": None, "tensor_parallel_size": 1, **cfg})
    flags = placement(ns, n)[0].flags
    named = dict(zip(flags[::2], flags[1::2]))
    out: dict[str, Any] = {"num_threads": int(named["--num-threads"])}
    if "--kv-cache-memory" in named:
        out["kv_cache_memory"] = named["--kv-cache-memory"]
    return out


# ---------------------------------------------------------------- running it
@dataclass
class Validation:
    measured_path: str
    inputs: BenchInputs
    sim_summary: dict
    sim_groups: dict
    sim_steps: dict
    rows: list[MetricComparison]
    group_rows: dict[str, list[MetricComparison]]
    calibration: Any  # Calibration
    tolerance: float

    @property
    def ok(self) -> bool:
        return all_targets_ok(self.rows)

    def to_dict(self) -> dict[str, Any]:
        from tokenloom.measure.report import to_jsonable

        return to_jsonable({
            "measured": self.measured_path,
            "model": self.inputs.model,
            "dtype": self.inputs.dtype,
            "workload": self.inputs.workload_name,
            "num_requests": len(self.inputs.requests),
            "data_parallel_size": self.inputs.data_parallel_size,
            "engine_threads": self.inputs.engine_threads,
            "max_concurrency": self.inputs.max_concurrency,
            "sim_config": self.inputs.sim_config.to_dict(),
            "kv_blocks_from": self.inputs.kv_blocks_note,
            "tolerance": self.tolerance,
            "within_tolerance": self.ok,
            "comparison": [r.to_dict() for r in self.rows],
            "groups": {g: [r.to_dict() for r in rows] for g, rows in self.group_rows.items()},
            "simulated": {"summary": self.sim_summary, "groups": self.sim_groups, "steps": self.sim_steps},
            "calibration": self.calibration.to_dict(with_samples=False),
        })


def validate(measured_path: str | Path, *, tolerance: float = DEFAULT_TOLERANCE, recalibrate: bool = False,
             log=None, measure: MeasureEngine | None = None) -> Validation:
    from tokenloom.measure import metrics
    from tokenloom.sim.calibrate import calibrated_cost_model
    from tokenloom.specs.model_spec import load_config, max_position_embeddings
    from tokenloom.sim.simulator import Simulator

    doc = json.loads(Path(measured_path).read_text(encoding="utf-8"))
    inp = inputs_from_bench(doc)
    cm = calibrated_cost_model(inp.model, inp.dtype, block_size=inp.sim_config.block_size, mode="serve",
                               num_threads=inp.engine_threads, replicas=inp.data_parallel_size,
                               refresh=recalibrate, log=log, measure=measure)
    config, _ = load_config(inp.model)
    if inp.data_parallel_size > 1:  # the replicas behind the router policy `serve -dp` uses
        from tokenloom.sim.fleet import FleetSimulator

        sim = FleetSimulator(cm, inp.sim_config, num_replicas=inp.data_parallel_size, router="cache-aware",
                             model_max_positions=max_position_embeddings(config))
    else:
        sim = Simulator(cm, inp.sim_config, model_max_positions=max_position_embeddings(config))
    res = sim.run(inp.requests, max_concurrency=inp.max_concurrency)
    summary = metrics.summarize(res.records, duration=res.duration_s).to_dict()
    groups = {g: s.to_dict() for g, s in metrics.summarize_by_group(res.records, duration=res.duration_s).items()}
    real = doc["results"]["summary"]
    real_groups = doc["results"].get("groups") or {}
    rows = compare(real, summary, tolerance=tolerance)
    group_rows = {g: compare(real_groups[g], groups[g], tolerance=tolerance, metrics=GROUP_METRICS)
                  for g in sorted(set(real_groups) & set(groups))}
    return Validation(str(measured_path), inp, summary, groups, res.steps.summary(), rows, group_rows,
                      cm.calibration, tolerance)


# ---------------------------------------------------------------- a whole sweep
SWEEP_METRICS: tuple[Metric, ...] = TARGET_METRICS + (Metric("ttft_p95", "P95 TTFT (ms)", ("ttft_ms", "p95"), False),)


def sweep_row_summary(row: Mapping[str, Any]) -> dict:
    """A `bench sweep` point row in the shape of a summary dict (for `compare`)."""
    return {"output_throughput": row.get("output_throughput"),
            "ttft_ms": {"median": row.get("ttft_p50_ms"), "p95": row.get("ttft_p95_ms")},
            "tpot_ms": {"median": row.get("tpot_p50_ms"), "p95": row.get("tpot_p95_ms")}}


@dataclass
class SweepValidation:
    measured_path: str
    model: str
    dtype: str
    workload_name: str
    num_requests: int
    points: list[tuple[dict, list[MetricComparison]]]  # (point, comparison rows)
    calibration: Any
    tolerance: float

    @property
    def ok(self) -> bool:
        return all(all_targets_ok(rows) for _, rows in self.points)

    def to_dict(self) -> dict[str, Any]:
        from tokenloom.measure.report import to_jsonable

        return to_jsonable({
            "measured": self.measured_path, "model": self.model, "dtype": self.dtype,
            "workload": self.workload_name, "num_requests": self.num_requests, "tolerance": self.tolerance,
            "within_tolerance": self.ok,
            "points": [{"point": p, "comparison": [r.to_dict() for r in rows]} for p, rows in self.points],
            "calibration": self.calibration.to_dict(with_samples=False),
        })


def validate_sweep(measured_path: str | Path, doc: Mapping[str, Any], *, tolerance: float = DEFAULT_TOLERANCE,
                   recalibrate: bool = False, log=None, measure: MeasureEngine | None = None) -> SweepValidation:
    """Every point of a `bench sweep` JSON, simulated with the same limits and workload."""
    from tokenloom.measure import metrics
    from tokenloom.sim.calibrate import calibrated_cost_model
    from tokenloom.specs.model_spec import load_config, max_position_embeddings
    from tokenloom.sim.simulator import Simulator

    points = []
    cm = None
    inp = None
    for row in doc["results"]["points"]:
        if row.get("error"):
            continue
        point = {"max_num_seqs": row["max_num_seqs"], "max_num_batched_tokens": row["max_num_batched_tokens"],
                 "enable_chunked_prefill": row["chunked_prefill"]}
        inp = inputs_from_bench(doc, point)
        if cm is None:
            # An offline sweep ran the engine in-process: calibrate it the same way.
            mode = "serve" if doc.get("config", {}).get("mode") == "serve" else "offline"
            cm = calibrated_cost_model(inp.model, inp.dtype, block_size=inp.sim_config.block_size, mode=mode,
                                       refresh=recalibrate, log=log, measure=measure)
        config, _ = load_config(inp.model)
        sim = Simulator(cm, inp.sim_config, model_max_positions=max_position_embeddings(config))
        res = sim.run(inp.requests, max_concurrency=inp.max_concurrency)
        summary = metrics.summarize(res.records, duration=res.duration_s).to_dict()
        points.append((point, compare(sweep_row_summary(row), summary, tolerance=tolerance, metrics=SWEEP_METRICS)))
    if inp is None or cm is None:
        raise ValueError("the sweep has no successful point to compare with")
    return SweepValidation(str(measured_path), inp.model, inp.dtype, inp.workload_name, len(inp.requests), points,
                           cm.calibration, tolerance)


def sweep_table(v: SweepValidation) -> Any:
    from rich.table import Table

    t = Table(title="bench sweep: measured / simulated (error)")
    for col in ("seqs", "batched tok", "chunked", *(m.label for m in SWEEP_METRICS)):
        t.add_column(col, justify="right")
    for point, rows in v.points:
        cells = [f"{_fmt(r.measured)} / {_fmt(r.simulated)} ({_err(r)})" for r in rows]
        t.add_row(str(point["max_num_seqs"]), str(point["max_num_batched_tokens"]),
                  "on" if point["enable_chunked_prefill"] else "off", *cells)
    return t


# ---------------------------------------------------------------- printing
def _fmt(v: float) -> str:
    if not math.isfinite(v):
        return "-"
    return f"{v:,.1f}" if abs(v) >= 10 else f"{v:.2f}"


def _err(r: MetricComparison) -> str:
    return "-" if not math.isfinite(r.rel_error) else f"{100 * r.rel_error:+.1f}%"


def comparison_table(rows: Sequence[MetricComparison], title: str) -> Any:
    from rich.table import Table

    t = Table(title=title)
    for col, just in (("metric", "left"), ("measured", "right"), ("simulated", "right"), ("error", "right"),
                      ("", "left")):
        t.add_column(col, justify=just)
    for r in rows:
        verdict = ("ok" if r.ok else f"> {100 * r.tolerance:.0f}%") if r.target else ""
        t.add_row(r.label, _fmt(r.measured), _fmt(r.simulated), _err(r), verdict)
    return t


def markdown_table(rows: Sequence[MetricComparison]) -> str:
    lines = ["| metric | measured | simulated | error |", "|---|---:|---:|---:|"]
    lines += [f"| {r.label} | {_fmt(r.measured)} | {_fmt(r.simulated)} | {_err(r)} |" for r in rows]
    return "\n".join(lines)


def print_validation(v: Validation, console: Any) -> None:
    inp, sc = v.inputs, v.inputs.sim_config
    console.print(
        f"validate: {v.measured_path} | {inp.workload_name}, {len(inp.requests)} requests, "
        + (f"{inp.data_parallel_size} replicas (cache-aware router), " if inp.data_parallel_size > 1 else "")
        + (f"{inp.engine_threads} thread(s) per engine, " if inp.engine_threads else "")
        + f"concurrency {inp.max_concurrency or 'unlimited'} | {Path(inp.model).name} ({inp.dtype}) | "
        f"max_num_seqs {sc.max_num_seqs}, max_num_batched_tokens {sc.max_num_batched_tokens}, "
        f"max_model_len {sc.max_model_len}, chunked prefill {'on' if sc.enable_chunked_prefill else 'off'}, "
        f"{sc.num_kv_blocks} KV blocks ({inp.kv_blocks_note})", markup=False, soft_wrap=True)
    console.print("calibrated `local` cost model: " + "; ".join(v.calibration.summary_lines()),
                  markup=False, soft_wrap=True)
    console.print(comparison_table(v.rows, "measured (bench serve) vs simulated (calibrated local)"))
    for g, rows in v.group_rows.items():
        console.print(comparison_table(rows, f"group {g!r}"))
    n_ok = sum(r.ok for r in v.rows if r.target)
    n = sum(r.target for r in v.rows)
    console.print(f"{n_ok}/{n} headline figures within {100 * v.tolerance:.0f}%"
                  + ("" if v.ok else "  (VALIDATION FAILED)"), markup=False)


def main(args: argparse.Namespace) -> int:
    """`tokenloom simulate --compare-with FILE`."""
    from tokenloom.measure.report import wide_console, write_json

    console = wide_console()
    log = lambda s: console.print(s, markup=False)  # noqa: E731
    measure = getattr(args, "measure_engine", None)  # the engine run the `tokenloom` command hands in
    try:
        doc = json.loads(Path(args.compare_with).read_text(encoding="utf-8"))
        if doc.get("benchmark") == "sweep":
            v = validate_sweep(args.compare_with, doc, tolerance=args.tolerance, recalibrate=args.recalibrate,
                               log=log, measure=measure)
        else:
            v = validate(args.compare_with, tolerance=args.tolerance, recalibrate=args.recalibrate, log=log,
                         measure=measure)
    except (OSError, KeyError, ValueError) as e:
        console.print(f"error: {e}", markup=False)
        return 2
    if isinstance(v, SweepValidation):
        console.print(f"validate: {v.measured_path} | {v.workload_name}, {v.num_requests} requests | "
                      f"{Path(v.model).name} ({v.dtype}) | calibrated `local` cost model: "
                      + "; ".join(v.calibration.summary_lines()), markup=False, soft_wrap=True)
        console.print(sweep_table(v))
        n_ok = sum(r.ok for _, rows in v.points for r in rows if r.target)
        n = sum(r.target for _, rows in v.points for r in rows)
        console.print(f"{n_ok}/{n} headline figures within {100 * v.tolerance:.0f}%", markup=False)
    else:
        print_validation(v, console)
    if args.output_json:
        write_json(args.output_json, v.to_dict())
        console.print(f"wrote {args.output_json}", markup=False)
    return 0 if v.ok else 1
