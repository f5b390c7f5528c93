"""Published figures vs this cost model: the table docs/predictions.md holds and its test recomputes.

For each `specs.published.Figure` the same setup is predicted with the default (central)
efficiencies and with the band's low and high profiles (`sim.efficiency.BANDS`):

* decode: 1 / step time (tokens/s per sequence at batch 1; batch / step time otherwise) at
  the mean context of the run;
* ttft: the prefill step of `prompt_len` tokens, which also samples the first token;
* static: batch * output_len / (the batch's prefill step + output_len - 1 decode steps at the
  mean context), per GPU when the source reports it so;
* serve: the simulator -- the engine's own scheduler and KV cache on this cost model -- with
  the requests and engine limits the source gives.

`ratio = predicted / measured` for every metric (>1: the prediction is faster for tok/s,
slower for milliseconds); a figure is "within 20%" when |ratio - 1| <= 0.2 and "off by" is
max(ratio, 1/ratio).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Iterable, Sequence

from tokenloom.sim.efficiency import BANDS, CENTRAL, Efficiency
from tokenloom.sim.estimate import CostModel
from tokenloom.specs.hardware import get_hardware
from tokenloom.specs.model_spec import load_config, load_model_spec, max_position_embeddings
from tokenloom.specs.published import FIGURES, Figure

# The targets issue 40 sets for the published figures.
WITHIN = 0.20
TARGET_FRACTION_WITHIN = 0.80
TARGET_MEDIAN_ERROR = 0.10
TARGET_MAX_OFF = 1.6


def cost_model(fig: Figure, eff: Efficiency = CENTRAL) -> CostModel:
    return CostModel(load_model_spec(fig.model), get_hardware(fig.hardware), fig.dtype,
                     weight_format=fig.weight_format, kv_cache_dtype=fig.kv_cache_dtype, tensor_parallel_size=fig.tp,
                     efficiency=eff)


def _decode(cm: CostModel, fig: Figure) -> float:
    ctx = fig.prompt_len + fig.output_len // 2
    return fig.batch / cm.decode_cost(fig.batch, ctx).time_s


def _ttft_ms(cm: CostModel, fig: Figure) -> float:
    return 1e3 * cm.entries_cost([(fig.prompt_len, 0, True)]).time_s


def _static(cm: CostModel, fig: Figure) -> float:
    b, i, o = fig.batch, fig.prompt_len, fig.output_len
    prefill = cm.entries_cost([(i, 0, True)] * b).time_s
    decode = (o - 1) * cm.decode_cost(b, i + o // 2).time_s
    tok_s = b * o / (prefill + decode)
    return tok_s / fig.tp if fig.per_gpu else tok_s


def _serve(cm: CostModel, fig: Figure) -> float:
    from tokenloom.measure import metrics
    from tokenloom.measure.workloads import BenchRequest
    from tokenloom.sim.simulator import SimConfig, Simulator

    limits = dict(fig.engine_limits)
    cfg = SimConfig(max_num_seqs=int(limits.get("max_num_seqs", 256)),
                    max_num_batched_tokens=limits.get("max_num_batched_tokens"),
                    max_model_len=fig.prompt_len + fig.output_len, block_size=int(limits.get("block_size", 32)),
                    gpu_memory_utilization=float(limits.get("gpu_memory_utilization", 0.9)),
                    enable_chunked_prefill=True, enable_prefix_caching=False)
    config, _ = load_config(fig.model)
    sim = Simulator(cm, cfg, model_max_positions=max_position_embeddings(config))
    # Distinct prompts (no prefix-cache hits), all sent at once as the benchmarks do.
    reqs = [BenchRequest([10 + (j + 7 * k) % 30000 for j in range(fig.prompt_len)], fig.output_len)
            for k in range(fig.num_prompts)]
    res = sim.run(reqs, max_concurrency=fig.concurrency)
    s = metrics.summarize(res.records, duration=res.duration_s).to_dict()
    if fig.metric == "output_tok_s":
        return float(s["output_throughput"])
    if fig.metric == "ttft_ms":
        return float(s["ttft_ms"]["median"])
    if fig.metric == "tpot_ms":
        return float(s["tpot_ms"]["median"])
    raise ValueError(f"{fig.key}: unknown serve metric {fig.metric!r}")


_SCENARIOS = {"decode": _decode, "ttft": _ttft_ms, "static": _static, "serve": _serve}


def predict(fig: Figure, eff: Efficiency = CENTRAL) -> float:
    """The figure's metric for its setup, with efficiencies `eff`."""
    try:
        fn = _SCENARIOS[fig.scenario]
    except KeyError:
        raise ValueError(f"{fig.key}: unknown scenario {fig.scenario!r}") from None
    return fn(cost_model(fig, eff), fig)


@dataclass(frozen=True)
class Row:
    fig: Figure
    predicted: float
    low: float  # the weaker engines' end of the band (slower)
    high: float  # the better engines' end (faster)

    @property
    def ratio(self) -> float:
        return self.predicted / self.fig.measured

    @property
    def error(self) -> float:
        return abs(self.ratio - 1.0)

    @property
    def off_by(self) -> float:
        return max(self.ratio, 1.0 / self.ratio)

    @property
    def in_band(self) -> bool:
        lo, hi = sorted((self.low, self.high))
        return lo <= self.fig.measured <= hi


def rows(figures: Iterable[Figure] = FIGURES, eff: Efficiency = CENTRAL, bands: bool = True) -> list[Row]:
    out = []
    for f in figures:
        p = predict(f, eff)
        if bands:
            lo, hi = predict(f, BANDS["low"]), predict(f, BANDS["high"])
        else:
            lo = hi = math.nan
        out.append(Row(f, p, lo, hi))
    return out


@dataclass(frozen=True)
class Summary:
    count: int
    fraction_within: float
    median_error: float
    max_off_by: float
    too_fast: int  # predictions faster than measured
    in_band: int

    @property
    def meets_targets(self) -> bool:
        return (self.fraction_within >= TARGET_FRACTION_WITHIN and self.median_error <= TARGET_MEDIAN_ERROR
                and self.max_off_by <= TARGET_MAX_OFF)


def _faster(r: Row) -> bool:
    return r.ratio < 1 if r.fig.metric.endswith("ms") else r.ratio > 1


def summarize(rs: Sequence[Row]) -> Summary:
    if not rs:
        raise ValueError("no rows")
    return Summary(
        count=len(rs),
        fraction_within=sum(r.error <= WITHIN for r in rs) / len(rs),
        median_error=statistics.median(r.error for r in rs),
        max_off_by=max(r.off_by for r in rs),
        too_fast=sum(_faster(r) for r in rs),
        in_band=sum(r.in_band for r in rs),
    )


def _fmt(x: float) -> str:
    if x >= 1000:
        return f"{x:,.0f}"
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


_UNITS = {"tok_s": "tok/s", "output_tok_s": "out tok/s", "ms": "ms TTFT", "ttft_ms": "ms TTFT", "tpot_ms": "ms TPOT"}


def markdown_table(rs: Sequence[Row]) -> str:
    """The table docs/predictions.md holds (between its markers); the test compares it verbatim."""
    lines = ["| # | source | setup | measured | predicted (band) | ratio | set |",
             "|---:|---|---|---:|---:|---:|---|"]
    for i, r in enumerate(rs, 1):
        f = r.fig
        fmt = f.weight_format or f.dtype
        tp = f" x{f.tp}" if f.tp > 1 else ""
        what = {"decode": f"decode b{f.batch}", "ttft": f"prefill {f.prompt_len}",
                "static": f"batch {f.batch}, {f.prompt_len}/{f.output_len}",
                "serve": f"serve {f.num_prompts} x {f.prompt_len}/{f.output_len}"}[f.scenario]
        setup = f"{f.hardware}{tp}, {f.model}, {fmt}, {what}"
        unit = _UNITS[f.metric]
        band = f"{_fmt(min(r.low, r.high))}–{_fmt(max(r.low, r.high))}"
        lines.append(f"| {i} | [{f.source}]({f.url}) | {setup} | {_fmt(f.measured)} {unit} | "
                     f"{_fmt(r.predicted)} ({band}) | {r.ratio:.2f} | {'fit' if f.fit else 'check'} |")
    return "\n".join(lines)


def summary_line(label: str, s: Summary) -> str:
    return (f"{label}: {s.count} figures, {s.fraction_within:.0%} within 20%, median error "
            f"{100 * s.median_error:.1f}%, worst off by {s.max_off_by:.2f}x, {s.too_fast} predicted too fast, "
            f"{s.in_band} inside the band")


TABLE_START = "<!-- predictions-table:start (generated: python -m tokenloom.sim.predictions) -->"
TABLE_END = "<!-- predictions-table:end -->"


def doc_block(rs: Sequence[Row]) -> str:
    """What docs/predictions.md holds between its markers: the table and its three summaries."""
    fit = [r for r in rs if r.fig.fit]
    check = [r for r in rs if not r.fig.fit]
    lines = [TABLE_START, "", markdown_table(rs), "",
             "- " + summary_line("All", summarize(rs)),
             "- " + summary_line("Fit set (the defaults were set from these)", summarize(fit)),
             "- " + summary_line("Check set (never used to set a default)", summarize(check)),
             "", TABLE_END]
    return "\n".join(lines)


def doc_block_in(text: str) -> str:
    """The block between the markers of a document's text (ValueError when they are missing)."""
    try:
        a = text.index(TABLE_START)
        b = text.index(TABLE_END, a) + len(TABLE_END)
    except ValueError:
        raise ValueError("docs/predictions.md lacks the predictions-table markers") from None
    return text[a:b]


def main() -> None:
    """Print the block docs/predictions.md holds (or rewrite it there with --write PATH)."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description="published figures vs tokenloom's cost model")
    ap.add_argument("--write", metavar="DOC", help="replace the table block in this markdown file")
    args = ap.parse_args()
    block = doc_block(rows())
    if args.write:
        path = Path(args.write)
        text = path.read_text(encoding="utf-8")
        path.write_text(text.replace(doc_block_in(text), block), encoding="utf-8")
    else:
        print(block)


if __name__ == "__main__":
    main()
