"""Benchmark metrics: the seed's figures computed from per-request timelines.

Pure functions over `RequestRecord`s: no HTTP, no clock, no torch.  The serving client,
the offline benchmarks and the simulator (virtual clock) all fill the same records and
get the same numbers.

Per request (times in seconds on any one clock):

- TTFT  = first token time - send time            (prefill + first decode step + queueing)
- TPOT  = (E2E - TTFT) / (output tokens - 1)      (mean decode step seen by this request)
- ITL   = gaps between consecutive token arrivals (one per streamed chunk)
- E2E   = end time - send time

"Send time" is when the request was handed to the engine/server; it equals the arrival
time unless a client-side concurrency limit held it back (that wait is reported apart as
`queue_delay`, shown as "send delay", as vLLM's benchmark does).

The summary reports mean/median/p90/p95/p99 (numpy's linear-interpolation percentile) of
each, throughput (requests/s, output tokens/s, total tokens/s), goodput (requests meeting
every SLO) and peak concurrency.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np

DEFAULT_PERCENTILES: tuple[float, ...] = (50, 90, 95, 99)
SLO_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class RequestRecord:
    """What happened to one request, as seen by whoever measured it."""

    prompt_len: int
    output_len: int = 0  # tokens actually generated
    arrival_time: float = 0.0  # when the workload said it arrives
    send_time: float | None = None  # when it was handed over (None: = arrival_time)
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # each token/chunk arrival, first included
    end_time: float | None = None
    success: bool = True
    error: str | None = None
    group: str | None = None
    expected_output_len: int | None = None  # what was asked for (max_tokens)

    @property
    def start(self) -> float:
        return self.arrival_time if self.send_time is None else self.send_time

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------
# per-request figures
# ---------------------------------------------------------------------------


def ttft(r: RequestRecord) -> float | None:
    if not r.success or r.first_token_time is None:
        return None
    return r.first_token_time - r.start


def e2e_latency(r: RequestRecord) -> float | None:
    if not r.success or r.end_time is None:
        return None
    return r.end_time - r.start


def tpot(r: RequestRecord) -> float | None:
    """Mean time per output token after the first; undefined for one-token outputs."""
    t, e = ttft(r), e2e_latency(r)
    if t is None or e is None or r.output_len < 2:
        return None
    return (e - t) / (r.output_len - 1)


def itls(r: RequestRecord) -> list[float]:
    """Inter-token (inter-chunk) gaps; empty for failed or single-chunk requests."""
    if not r.success or len(r.token_times) < 2:
        return []
    return np.diff(np.asarray(r.token_times, dtype=float)).tolist()


def queue_delay(r: RequestRecord) -> float:
    """Client-side wait between arrival and send (a concurrency limit's queue)."""
    return 0.0 if r.send_time is None else max(0.0, r.send_time - r.arrival_time)


# ---------------------------------------------------------------------------
# distributions
# ---------------------------------------------------------------------------


@dataclass
class Distribution:
    """Summary of one metric over requests (values in the unit the caller chose)."""

    count: int
    mean: float
    median: float
    std: float
    min: float
    max: float
    percentiles: dict[str, float]  # "p90" -> value

    def p(self, q: float) -> float:
        return self.percentiles[_pkey(q)]

    def to_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "percentiles"}
        d.update(self.percentiles)
        return d


def _pkey(q: float) -> str:
    return f"p{q:g}"


def distribution(values: Iterable[float], percentiles: Sequence[float] = DEFAULT_PERCENTILES,
                 scale: float = 1.0) -> Distribution:
    """mean/median/std/min/max/percentiles of `values` * `scale`; NaNs when empty."""
    a = np.asarray(list(values), dtype=float) * scale
    if a.size == 0:
        nan = math.nan
        return Distribution(0, nan, nan, nan, nan, nan, {_pkey(q): nan for q in percentiles})
    pct = np.percentile(a, list(percentiles), method="linear") if percentiles else []
    return Distribution(
        count=int(a.size),
        mean=float(a.mean()),
        median=float(np.median(a)),
        std=float(a.std()),
        min=float(a.min()),
        max=float(a.max()),
        percentiles={_pkey(q): float(v) for q, v in zip(percentiles, pct)},
    )


# ---------------------------------------------------------------------------
# goodput and concurrency
# ---------------------------------------------------------------------------


def parse_goodput(items: Sequence[str] | str | None) -> dict[str, float]:
    """'ttft:500 tpot:50' (or a list of 'KEY:MS') -> {'ttft': 0.5, 'tpot': 0.05} in seconds."""
    if not items:
        return {}
    if isinstance(items, str):
        items = items.replace(",", " ").split()
    slos: dict[str, float] = {}
    for item in items:
        key, sep, val = item.partition(":")
        key = key.strip().lower()
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"--goodput takes KEY:MS with KEY in {'/'.join(SLO_METRICS)}; got {item!r}")
        try:
            ms = float(val)
        except ValueError:
            raise ValueError(f"--goodput {key}: {val!r} is not a number of milliseconds") from None
        if ms < 0:
            raise ValueError(f"--goodput {key}: must be >= 0 ms")
        slos[key] = ms / 1000.0
    return slos


def meets_slos(r: RequestRecord, slos: Mapping[str, float]) -> bool:
    """A successful request meets its SLOs when every given metric is <= its bound.
    A one-token output has no TPOT and passes that bound (nothing to be slow at)."""
    if not r.success:
        return False
    values = {"ttft": ttft(r), "tpot": tpot(r), "e2el": e2e_latency(r)}
    for key, bound in slos.items():
        v = values[key]
        if v is None:
            if key == "tpot" and r.output_len < 2 and values["e2el"] is not None:
                continue
            return False
        if v > bound:
            return False
    return True


def peak_concurrency(intervals: Iterable[tuple[float, float]]) -> int:
    """Most intervals open at once.  Touching intervals ([0,1] and [1,2]) do not overlap:
    at equal times ends are processed before starts."""
    events: list[tuple[float, int]] = []
    for s, e in intervals:
        events.append((s, 1))
        events.append((e, -1))
    events.sort(key=lambda x: (x[0], x[1]))
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def mean_concurrency(intervals: Sequence[tuple[float, float]], span: float | None = None) -> float:
    """Time-averaged number of open intervals over `span` (default: first start to last end)."""
    if not intervals:
        return 0.0
    if span is None:
        span = max(e for _, e in intervals) - min(s for s, _ in intervals)
    if span <= 0:
        return float(len(intervals))
    return sum(e - s for s, e in intervals) / span


def request_intervals(records: Iterable[RequestRecord]) -> list[tuple[float, float]]:
    return [(r.start, r.end_time) for r in records if r.success and r.end_time is not None]


# ---------------------------------------------------------------------------
# summary
# ---------------------------------------------------------------------------


@dataclass
class BenchSummary:
    """One run's headline numbers.  Latencies in milliseconds, throughputs per second."""

    num_requests: int
    completed: int
    failed: int
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests/s
    output_throughput: float  # generated tokens/s
    total_token_throughput: float  # (prompt + generated) tokens/s
    peak_concurrency: int
    mean_concurrency: float
    ttft_ms: Distribution
    tpot_ms: Distribution
    itl_ms: Distribution
    e2el_ms: Distribution
    queue_delay_ms: Distribution
    goodput_slos_ms: dict[str, float] = field(default_factory=dict)
    good_requests: int | None = None
    goodput: float | None = None  # good requests/s
    goodput_fraction: float | None = None  # good / all requests
    errors: list[str] = field(default_factory=list)  # first few distinct error messages

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for k, v in self.__dict__.items():
            d[k] = v.to_dict() if isinstance(v, Distribution) else v
        return d


def run_duration(records: Sequence[RequestRecord]) -> float:
    """First start to last end over all records (failed ones included if they ended)."""
    starts = [r.start for r in records]
    ends = [r.end_time for r in records if r.end_time is not None]
    if not starts or not ends:
        return 0.0
    return max(ends) - min(starts)


def summarize(records: Sequence[RequestRecord], *, duration: float | None = None,
              goodput_slos: Mapping[str, float] | None = None,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> BenchSummary:
    """Summary of a run.  `duration` (s) defaults to first start -> last end; pass the
    benchmark's own wall time when it has one so throughput covers the whole run."""
    ok = [r for r in records if r.success]
    if duration is None:
        duration = run_duration(records)
    per_s = (lambda x: x / duration) if duration > 0 else (lambda x: math.nan)
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    intervals = request_intervals(ok)

    def dist(fn) -> Distribution:
        return distribution((v for v in map(fn, ok) if v is not None), percentiles, scale=1000.0)

    summary = BenchSummary(
        num_requests=len(records),
        completed=len(ok),
        failed=len(records) - len(ok),
        duration_s=duration,
        total_input_tokens=total_in,
        total_output_tokens=total_out,
        request_throughput=per_s(len(ok)),
        output_throughput=per_s(total_out),
        total_token_throughput=per_s(total_in + total_out),
        peak_concurrency=peak_concurrency(intervals),
        mean_concurrency=mean_concurrency(intervals, duration if duration > 0 else None),
        ttft_ms=dist(ttft),
        tpot_ms=dist(tpot),
        itl_ms=distribution((g for r in ok for g in itls(r)), percentiles, scale=1000.0),
        e2el_ms=dist(e2e_latency),
        queue_delay_ms=distribution((queue_delay(r) for r in ok), percentiles, scale=1000.0),
        errors=sorted({r.error for r in records if r.error})[:5],
    )
    if goodput_slos:
        good = sum(1 for r in records if meets_slos(r, goodput_slos))
        summary.goodput_slos_ms = {k: v * 1000.0 for k, v in goodput_slos.items()}
        summary.good_requests = good
        summary.goodput = per_s(good)
        summary.goodput_fraction = good / len(records) if records else math.nan
    return summary


def summarize_by_group(records: Sequence[RequestRecord], *, duration: float | None = None,
                       goodput_slos: Mapping[str, float] | None = None,
                       percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, BenchSummary]:
    """One summary per `group` tag (e.g. mixed-long's "short" vs "long"); throughputs
    use the whole run's duration so the groups' rates add up to the total."""
    if duration is None:
        duration = run_duration(records)
    groups: dict[str, list[RequestRecord]] = {}
    for r in records:
        if r.group is not None:
            groups.setdefault(r.group, []).append(r)
    return {g: summarize(rs, duration=duration, goodput_slos=goodput_slos, percentiles=percentiles)
            for g, rs in sorted(groups.items())}


def parse_percentiles(text: str | Sequence[float]) -> tuple[float, ...]:
    """'50,90,95,99' -> (50.0, 90.0, 95.0, 99.0)."""
    if isinstance(text, str):
        vals = [float(x) for x in text.replace(" ", "").split(",") if x]
    else:
        vals = [float(x) for x in text]
    for v in vals:
        if not 0 <= v <= 100:
            raise ValueError(f"percentiles must be in [0, 100]; got {v:g}")
    return tuple(vals)
