"""`tokenloom bench sweep`: the batching knobs against throughput and tail latency.

The seed asks why `max-num-batched-tokens` matters more than `max-num-seqs`.  This runs
one workload (same seed, same arrivals) at every point of the grid
`--max-num-seqs-list` x `--max-num-batched-tokens-list` (x chunked prefill on/off), either
in-process (the offline engine, requests added at their arrival times) or against a
freshly launched server per point, and records throughput, P95 TPOT and P95 TTFT for
each.  Output: a table, `--output-json`, `--output-csv` and `--output-png` (throughput vs
P95 TPOT and vs P95 TTFT: up-and-left is better).
"""

from __future__ import annotations

import argparse
import csv
import gc
import itertools
import math
from pathlib import Path
from typing import Any, Sequence

from rich.console import Console

from tokenloom.measure import metrics, report
from tokenloom.measure.workloads import BenchRequest, WorkloadSpec, workload_from_args, workload_stats


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    chunked = {"on": [True], "off": [False], "both": [True, False]}[args.chunked_prefill]
    return [{"max_num_seqs": s, "max_num_batched_tokens": t, "enable_chunked_prefill": c}
            for c, s, t in itertools.product(chunked, _ints(args.max_num_seqs_list),
                                             _ints(args.max_num_batched_tokens_list))]


def point_row(point: dict[str, Any], summary: metrics.BenchSummary | None, steps: dict[str, Any] | None,
              error: str | None = None) -> dict[str, Any]:
    row: dict[str, Any] = {
        "max_num_seqs": point["max_num_seqs"],
        "max_num_batched_tokens": point["max_num_batched_tokens"],
        "chunked_prefill": point["enable_chunked_prefill"],
    }
    if summary is None:
        return {**row, "error": error}
    row.update({
        "completed": summary.completed,
        "request_throughput": summary.request_throughput,
        "output_throughput": summary.output_throughput,
        "total_token_throughput": summary.total_token_throughput,
        "ttft_p50_ms": summary.ttft_ms.median,
        "ttft_p95_ms": summary.ttft_ms.percentiles.get("p95", math.nan),
        "tpot_p50_ms": summary.tpot_ms.median,
        "tpot_p95_ms": summary.tpot_ms.percentiles.get("p95", math.nan),
        "itl_p95_ms": summary.itl_ms.percentiles.get("p95", math.nan),
        "e2el_p95_ms": summary.e2el_ms.percentiles.get("p95", math.nan),
        "goodput": summary.goodput,
        "mean_batch_size": (steps or {}).get("mean_batch_size"),
        "num_preemptions": (steps or {}).get("num_preemptions"),
        "error": error,
    })
    return row


def run_point_offline(args: argparse.Namespace, point: dict[str, Any], reqs: Sequence[BenchRequest],
                      spec: WorkloadSpec, slos: dict, percentiles: Sequence[float], progress: bool) -> dict[str, Any]:
    from tokenloom.bench.offline import build_llm, engine_vocab_range, run_offline, warmup

    llm = build_llm(args, **point)
    try:
        warmup(llm, engine_vocab_range(llm))
        run = run_offline(llm, reqs, ignore_eos=spec.ignore_eos, progress=progress)
        s = metrics.summarize(run.records, duration=run.duration_s, goodput_slos=slos, percentiles=percentiles)
        return point_row(point, s, run.steps.summary())
    finally:
        del llm
        gc.collect()  # free the KV cache before the next point allocates its own


def run_point_serve(args: argparse.Namespace, point: dict[str, Any], reqs: Sequence[BenchRequest],
                    spec: WorkloadSpec, slos: dict, percentiles: Sequence[float], progress: bool) -> dict[str, Any]:
    from tokenloom.bench.launcher import engine_flags_from_args, launch_server
    from tokenloom.bench.serve import run_serve_benchmark

    ns = argparse.Namespace(**{**vars(args), **point})
    flags = engine_flags_from_args(ns)
    model = args.model
    if model is None:
        from tokenloom.bundled import BUNDLED_MODEL_DIR

        model = str(BUNDLED_MODEL_DIR)
    with launch_server(model, flags) as server:
        run = run_serve_benchmark(server.base_url, reqs, max_concurrency=args.max_concurrency,
                                  ignore_eos=spec.ignore_eos, progress=progress)
    s = metrics.summarize(run.records, duration=run.duration_s, goodput_slos=slos, percentiles=percentiles)
    return point_row(point, s, None)


def _workload(args: argparse.Namespace) -> tuple[WorkloadSpec, list[BenchRequest]]:
    """The workload every point replays: vocab and max length from the model directory."""
    from tokenloom.measure.workloads import vocab_range_for_model

    model_dir = args.model
    if model_dir is None:
        from tokenloom.bundled import BUNDLED_MODEL_DIR

        model_dir = str(BUNDLED_MODEL_DIR)
    from tokenloom.model.weights.loader import resolve_model_path  # a directory with config.json, or fetched

    model_dir = str(resolve_model_path(model_dir, args.revision))
    vocab = vocab_range_for_model(args.tokenizer or model_dir)
    from tokenloom.specs.model_spec import load_config, max_position_embeddings

    max_len = args.max_model_len or max_position_embeddings(load_config(model_dir)[0])
    return workload_from_args(args, vocab, max_model_len=max_len)


def write_csv(path: str | Path, rows: Sequence[dict[str, Any]]) -> None:
    keys: list[str] = []
    for r in rows:
        keys += [k for k in r if k not in keys]
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k) for k in keys})


def plot(path: str | Path, rows: Sequence[dict[str, Any]], title: str = "") -> None:
    """Output tokens/s against P95 TPOT and P95 TTFT, one labelled point per setting."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on benchmark machines
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.get("error") and r.get("output_throughput")]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5), sharey=True)
    budgets = sorted({r["max_num_batched_tokens"] for r in ok})
    cmap = plt.get_cmap("viridis", max(len(budgets), 2))
    for ax, key, label in ((axes[0], "tpot_p95_ms", "P95 TPOT (ms)"), (axes[1], "ttft_p95_ms", "P95 TTFT (ms)")):
        for r in ok:
            color = cmap(budgets.index(r["max_num_batched_tokens"]))
            marker = "o" if r["chunked_prefill"] else "s"
            ax.scatter(r[key], r["output_throughput"], color=color, marker=marker, s=50,
                       edgecolors="black", linewidths=0.5)
            ax.annotate(f"seqs={r['max_num_seqs']}\ntok={r['max_num_batched_tokens']}", (r[key], r["output_throughput"]),
                        fontsize=7, xytext=(4, 4), textcoords="offset points")
        ax.set_xlabel(label)
        ax.grid(True, alpha=0.3)
    axes[0].set_ylabel("output tokens/s")
    handles = [plt.Line2D([], [], marker="o", linestyle="", color=cmap(i), label=f"max-num-batched-tokens={b}")
               for i, b in enumerate(budgets)]
    if any(not r["chunked_prefill"] for r in ok):
        handles += [plt.Line2D([], [], marker="s", linestyle="", color="gray", label="no chunked prefill")]
    axes[1].legend(handles=handles, fontsize=8, loc="best")
    fig.suptitle(title or "throughput vs tail latency (up and left is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    console = Console()
    slos = metrics.parse_goodput(args.goodput)
    percentiles = metrics.parse_percentiles(args.percentiles)
    if 95 not in percentiles:
        percentiles = tuple(sorted({*percentiles, 95.0}))
    spec, reqs = _workload(args)
    points = grid(args)
    console.print(f"[bold]bench sweep[/bold] mode={args.mode} workload={spec.name} requests={len(reqs)} "
                  f"rate={spec.request_rate} points={len(points)}")
    runner = run_point_offline if args.mode == "offline" else run_point_serve
    rows = []
    for i, point in enumerate(points, 1):
        desc = ", ".join(f"{k}={v}" for k, v in point.items())
        console.print(f"[{i}/{len(points)}] {desc}")
        try:
            row = runner(args, point, reqs, spec, slos, percentiles, not args.disable_tqdm)
        except (ValueError, RuntimeError) as e:  # an invalid combination is a result, not a crash
            console.print(f"  [yellow]skipped:[/yellow] {e}")
            row = point_row(point, None, None, error=str(e))
        rows.append(row)
        if not row.get("error"):
            console.print(f"  {row['output_throughput']:.1f} out tok/s, P95 TPOT {row['tpot_p95_ms']:.1f} ms, "
                          f"P95 TTFT {row['ttft_p95_ms']:.1f} ms")
    cols = ["max_num_seqs", "max_num_batched_tokens", "chunked_prefill", "output_throughput", "tpot_p95_ms",
            "ttft_p95_ms", "e2el_p95_ms", "mean_batch_size"]
    short = {"max_num_seqs": "seqs", "max_num_batched_tokens": "batched tok", "chunked_prefill": "chunked",
             "output_throughput": "out tok/s", "tpot_p95_ms": "TPOT p95", "ttft_p95_ms": "TTFT p95",
             "e2el_p95_ms": "E2E p95", "mean_batch_size": "mean batch"}
    console.print(report.rows_table([{short[k]: r.get(k) for k in cols} for r in rows if not r.get("error")],
                                    "Sweep (latencies in ms)", digits=1))
    if args.output_json:
        doc = report.build_report("sweep", config=report.args_to_config(args),
                                  workload={"spec": spec.to_dict(), "stats": workload_stats(reqs)},
                                  results={"points": rows})
        report.write_json(args.output_json, doc)
        console.print(f"wrote {args.output_json}")
    if args.output_csv:
        write_csv(args.output_csv, rows)
        console.print(f"wrote {args.output_csv}")
    if args.output_png:
        plot(args.output_png, rows, title=f"bench sweep: {spec.name}, {len(reqs)} requests, rate {spec.request_rate}")
        console.print(f"wrote {args.output_png}")
    return 0 if any(not r.get("error") for r in rows) else 1
