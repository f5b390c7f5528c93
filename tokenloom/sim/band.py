"""The band of a simulation: the same requests on engines of lesser and greater quality.

`sim.efficiency.BANDS` holds the low and high efficiency profiles; `simulate` runs its requests
on each (same seed, same engine limits) and prints their headline figures beside the central
run's, so a planner reads a range, not one number.
"""

from __future__ import annotations

import argparse


_BAND_METRICS = (("output tok/s", ("output_throughput",)), ("median TTFT (ms)", ("ttft_ms", "median")),
                 ("P95 TTFT (ms)", ("ttft_ms", "p95")), ("median TPOT (ms)", ("tpot_ms", "median")),
                 ("P95 TPOT (ms)", ("tpot_ms", "p95")))


def band_figures(summary) -> dict:
    d = summary.to_dict() if hasattr(summary, "to_dict") else summary
    out = {}
    for label, path in _BAND_METRICS:
        v = d
        for k in path:
            v = v.get(k) if isinstance(v, dict) else None
        out[label] = v
    return out


def band_runs(cm, sim_cfg, args: argparse.Namespace, max_positions: int | None, reqs, percentiles) -> dict:
    """The same requests on the band's low and high ends (`sim.efficiency.BANDS`): {label: figures}."""
    from tokenloom.measure import metrics
    from tokenloom.sim.efficiency import BANDS
    from tokenloom.sim.simulator import Simulator

    out = {}
    for label in ("low", "high"):
        other = cm.with_efficiency(BANDS[label])
        if args.replicas != 1:
            from tokenloom.sim.fleet import FleetSimulator

            sim = FleetSimulator(other, sim_cfg, num_replicas=args.replicas, router=args.router,
                                 model_max_positions=max_positions)
        else:
            sim = Simulator(other, sim_cfg, model_max_positions=max_positions)
        res = sim.run(reqs, seed=args.seed, max_concurrency=args.max_concurrency)
        out[label] = band_figures(metrics.summarize(res.records, duration=res.duration_s, percentiles=percentiles))
    return out


def band_table(band: dict) -> "object":
    """Central figures beside what engines of lesser (low) and greater (high) quality reach."""
    from rich.table import Table

    t = Table(title="Band: the same requests on engines of lesser / greater quality (sim.efficiency.BANDS)")
    for col in ("metric", "low", "central", "high"):
        t.add_column(col, justify="right")
    for label, _ in _BAND_METRICS:
        cells = [band[k].get(label) for k in ("low", "central", "high")]
        t.add_row(label, *("-" if v is None else f"{v:,.1f}" for v in cells))
    return t
