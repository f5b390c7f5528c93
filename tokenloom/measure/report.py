"""Benchmark reports: rich tables for people, JSON files for tools.

Every benchmark's `--output-json F` goes through `write_json`, which records what was
run (config), on what requests (workload) and where (machine: CPU model, family and model
numbers, the kernels' instruction sets, threads, torch version, platform) next to the
results, so numbers from different machines and runs can be compared without guessing.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any, Mapping

from rich.console import Console
from rich.table import Table

from tokenloom.measure.metrics import BenchSummary, Distribution
from tokenloom.specs.host import cpu_identity, cpu_model_name

SCHEMA_VERSION = 1


# ---------------------------------------------------------------------------
# machine
# ---------------------------------------------------------------------------


def machine_info() -> dict[str, Any]:
    """Where the benchmark ran.  Imports torch (already loaded by any engine run)."""
    info: dict[str, Any] = {
        "cpu_model": cpu_model_name(),
        "cpu": cpu_identity(),
        "logical_cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "hostname": platform.node(),
    }
    try:
        info["usable_cpus"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    try:
        import psutil

        info["physical_cpus"] = psutil.cpu_count(logical=False)
        info["memory_total_gib"] = round(psutil.virtual_memory().total / 2**30, 2)
    except Exception:  # psutil is optional here: the report must still be written
        pass
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
        info["torch_interop_threads"] = torch.get_num_interop_threads()
        if torch.cuda.is_available():
            info["cuda"] = torch.version.cuda
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:
        info["torch"] = None
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        if os.environ.get(var):
            info[var] = os.environ[var]
    return info


# ---------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, paths, tuples, numpy scalars and non-finite floats -> plain JSON."""
    if hasattr(obj, "to_dict") and callable(obj.to_dict):
        return to_jsonable(obj.to_dict())
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, float):
        # JSON has no inf/nan; null keeps the file loadable everywhere.
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if isinstance(obj, Path):
        return str(obj)
    try:  # numpy scalars
        return to_jsonable(obj.item())
    except AttributeError:
        return str(obj)


def args_to_config(args: Any, drop: tuple[str, ...] = ("func",)) -> dict[str, Any]:
    """An argparse Namespace as a JSON-able dict (callables dropped)."""
    return {k: to_jsonable(v) for k, v in sorted(vars(args).items()) if k not in drop and not callable(v)}


def build_report(kind: str, *, config: Mapping[str, Any] | None = None, workload: Any = None,
                 results: Any = None, machine: Mapping[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    """The common JSON envelope of every benchmark."""
    report = {
        "schema_version": SCHEMA_VERSION,
        "benchmark": kind,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": dict(machine) if machine is not None else machine_info(),
        "config": config or {},
        "workload": workload,
        "results": results,
    }
    report.update(extra)
    return to_jsonable(report)


def write_json(path: str | Path, report: Mapping[str, Any]) -> Path:
    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(report), indent=2) + "\n", encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# tables
# ---------------------------------------------------------------------------


def fmt(v: Any, digits: int = 2) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        if not math.isfinite(v):
            return "-"
        return f"{v:,.{digits}f}"
    if isinstance(v, int):
        return f"{v:,}"
    return str(v)


def summary_table(s: BenchSummary, title: str = "Benchmark result") -> Table:
    """The seed's figures for one run: throughput, then TTFT/TPOT/ITL/E2E percentiles."""
    t = Table(title=title, show_header=False, title_justify="left")
    t.add_column("metric", style="bold")
    t.add_column("value", justify="right")
    rows = [
        ("Requests (completed / failed)", f"{s.completed:,} / {s.failed:,}"),
        ("Duration (s)", fmt(s.duration_s)),
        ("Input tokens", fmt(s.total_input_tokens)),
        ("Output tokens", fmt(s.total_output_tokens)),
        ("Request throughput (req/s)", fmt(s.request_throughput, 3)),
        ("Output token throughput (tok/s)", fmt(s.output_throughput)),
        ("Total token throughput (tok/s)", fmt(s.total_token_throughput)),
        ("Peak / mean concurrency", f"{s.peak_concurrency} / {fmt(s.mean_concurrency)}"),
    ]
    if s.goodput is not None:
        slo = ", ".join(f"{k}<={fmt(v, 0)}ms" for k, v in s.goodput_slos_ms.items())
        rows.append((f"Goodput ({slo}) (req/s)", fmt(s.goodput, 3)))
        rows.append(("Requests meeting SLOs", f"{s.good_requests} ({fmt(100 * (s.goodput_fraction or 0), 1)}%)"))
    for label, value in rows:
        t.add_row(label, value)
    return t


def latency_table(s: BenchSummary, title: str = "Latency (ms)") -> Table:
    t = Table(title=title, title_justify="left")
    t.add_column("metric", style="bold")
    # p50 is the median: show it once.
    keys = ["mean", "median"] + [k for k in s.ttft_ms.percentiles if k != "p50"]
    for k in keys:
        t.add_column(k, justify="right")
    for name, d in (("TTFT", s.ttft_ms), ("TPOT", s.tpot_ms), ("ITL", s.itl_ms), ("E2E", s.e2el_ms)):
        t.add_row(name, *(fmt(_dist_get(d, k)) for k in keys))
    # Arrival -> send: a --max-concurrency wait plus client scheduling lag; hidden when negligible.
    if s.queue_delay_ms.count and (s.queue_delay_ms.max or 0) > 1.0:
        t.add_row("send delay", *(fmt(_dist_get(s.queue_delay_ms, k)) for k in keys))
    return t


def _dist_get(d: Distribution, key: str) -> float:
    if key in ("mean", "median"):
        return getattr(d, key)
    return d.percentiles.get(key, math.nan)


def group_table(groups: Mapping[str, BenchSummary], title: str = "By request group (latencies in ms)") -> Table:
    """Side by side per group: the seed's "long prompts wreck P95" shows up here."""
    t = Table(title=title, title_justify="left")
    for col in ("group", "n", "mean in", "out tok/s", "TTFT p50", "TTFT p95",
                "TPOT p50", "TPOT p95", "E2E p95"):
        t.add_column(col, justify="right" if col != "group" else "left")
    for name, s in groups.items():
        mean_in = s.total_input_tokens / s.completed if s.completed else math.nan
        t.add_row(name, fmt(s.completed), fmt(mean_in, 0), fmt(s.output_throughput),
                  fmt(s.ttft_ms.median), fmt(s.ttft_ms.percentiles.get("p95")),
                  fmt(s.tpot_ms.median), fmt(s.tpot_ms.percentiles.get("p95")),
                  fmt(s.e2el_ms.percentiles.get("p95")))
    return t


def dict_table(rows: Mapping[str, Any], title: str = "") -> Table:
    t = Table(title=title or None, show_header=False, title_justify="left")
    t.add_column("key", style="bold")
    t.add_column("value", justify="right")
    for k, v in rows.items():
        t.add_row(str(k), fmt(v))
    return t


def rows_table(rows: list[Mapping[str, Any]], title: str = "", digits: int = 2) -> Table:
    """A list of same-keyed dicts as a table (sweeps, roofline points)."""
    t = Table(title=title or None, title_justify="left")
    if not rows:
        return t
    cols = list(rows[0].keys())
    for c in cols:
        t.add_column(str(c), justify="right")
    for r in rows:
        t.add_row(*(fmt(r.get(c), digits) for c in cols))
    return t


def wide_console() -> Console:
    """A console for wide tables: the terminal's width, or 180 columns when output is piped or
    captured (rich would otherwise squeeze the table into 80)."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=180)
    return console


def print_summary(s: BenchSummary, *, title: str = "Benchmark result",
                  groups: Mapping[str, BenchSummary] | None = None, console: Console | None = None) -> None:
    console = console or Console()
    console.print(summary_table(s, title))
    console.print(latency_table(s))
    if groups:
        console.print(group_table(groups))
    if s.errors:
        console.print("[red]errors:[/red] " + "; ".join(s.errors))
