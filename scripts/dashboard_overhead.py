"""What does an open dashboard cost the engine?  Step period with /dashboard/events open vs closed.

    python scripts/dashboard_overhead.py --model /tmp/m/qwen2.5-0.5b [--batch-size 32] [--rounds 8]

A real server (uvicorn in a thread of this process, the real CLI flags) decodes a steady
batch of `--batch-size` requests.  Rounds alternate: the event stream is read by a separate
process (`curl`, as a browser would be: not this process's GIL) or nobody reads it.  Per
round, the median *step period* -- start of one step to start of the next, so it includes
every observer, the server's output delivery, and the event loop's aggregation competing
for the GIL -- over the round's steps (the first two after a switch are dropped); and the CPU
time the pump itself spent on the event loop's thread (`time.thread_time`, which other
processes on the machine do not inflate the way they inflate wall time).  Reported:
the median over open rounds vs over closed rounds, and the ratio.  Also the recorder's own
cost per step and the aggregator's per update, timed on the real events of the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_fixtures import ThreadedServer  # noqa: E402

from tokenloom.bench.launcher import free_port  # noqa: E402
from tokenloom.dashboard.aggregate import Aggregator  # noqa: E402
from tokenloom.dashboard.recorder import StepBuffer, StepRecord  # noqa: E402


class Periods:
    """A step observer that keeps each step's start time."""

    def __init__(self) -> None:
        self.starts: list[float] = []
        self.last = None
        self.sample: list = []  # a few steady-state events, to time the recorder and aggregator on

    def __call__(self, event) -> None:
        self.starts.append(event.start_time)
        self.last = event
        if len(self.sample) < 64 and self.starts and len(self.starts) > 1:
            self.sample.append(event)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=8, help="alternating open/closed rounds (even)")
    ap.add_argument("--steps", type=int, default=12, help="steps measured per round")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=None, help="per request (default: enough for the rounds)")
    ap.add_argument("--json", default=None, help="write the figures here too")
    a = ap.parse_args()

    per_round = a.steps + 2
    max_tokens = a.max_tokens or per_round * a.rounds + 24
    srv = ThreadedServer([a.model, "--port", str(free_port()), "--max-num-seqs", str(a.batch_size),
                          "--max-model-len", str(a.prompt_tokens + max_tokens + 16), "--log-level", "warning",
                          "--disable-access-log", "--no-enable-prefix-caching"]).start()
    engine = srv.engine.engine
    periods = Periods()
    engine.add_observer(periods)

    def one(i: int) -> None:
        ids = [(i * 31 + j) % engine.vocab_size for j in range(a.prompt_tokens)]
        r = httpx.post(srv.base_url + "/v1/completions", timeout=3600,
                       json={"model": a.model, "prompt": ids, "max_tokens": max_tokens, "ignore_eos": True})
        if r.status_code != 200 and not measured.is_set():  # 503s at the end: the server stops
            print(f"request {i} failed: {r.status_code} {r.text[:200]}", file=sys.stderr, flush=True)

    measured = threading.Event()
    t_start = time.perf_counter()
    pool = ThreadPoolExecutor(a.batch_size)
    for i in range(a.batch_size):
        pool.submit(one, i)
    # Wait for the steady state: every request decoding.
    while not (periods.last is not None and len(periods.last.entries) == a.batch_size
               and all(e.phase == "decode" for e in periods.last.entries)):
        if time.perf_counter() - t_start > 600:
            raise SystemExit("the batch never reached its size: see the failures above")
        time.sleep(0.02)
    periods.sample.clear()

    hub = srv.server.config.app.state.dashboard
    pump_cpu = {"cpu_s": 0.0, "steps": 0, "wall_s": 0.0, "updates": 0}
    results: dict[str, list[float]] = {"open": [], "closed": []}
    url = srv.base_url + "/dashboard/events"
    for r in range(a.rounds):
        mode = "open" if r % 2 == 0 else "closed"
        reader = subprocess.Popen(["curl", "-sN", url], stdout=subprocess.DEVNULL) if mode == "open" else None
        first = len(periods.starts)
        cpu0, upd0, wall0 = hub.pump_cpu_s, hub.updates_sent, time.perf_counter()
        while len(periods.starts) < first + per_round + 1:
            if not engine.has_unfinished_requests():
                raise SystemExit("the requests finished before the rounds did: raise --max-tokens")
            time.sleep(0.02)
        starts = periods.starts[first + 2: first + per_round + 1]
        gaps = [b - a_ for a_, b in zip(starts, starts[1:])]
        results[mode].append(statistics.median(gaps))
        if mode == "open":
            pump_cpu["cpu_s"] += hub.pump_cpu_s - cpu0
            pump_cpu["updates"] += hub.updates_sent - upd0
            pump_cpu["wall_s"] += time.perf_counter() - wall0
            pump_cpu["steps"] += len(periods.starts) - first
        if reader is not None:
            reader.terminate()
            reader.wait()
        print(f"round {r}: {mode:6s} median step period {results[mode][-1] * 1e3:8.2f} ms", flush=True)

    # The recorder's and the aggregator's own cost, on this run's real batch-size events.
    events = [e for e in periods.sample if len(e.entries) == a.batch_size] or periods.sample
    rec = StepBuffer(engine)
    n = 2000
    t = time.perf_counter()
    for i in range(n):
        rec(events[i % len(events)])
    recorder_us = (time.perf_counter() - t) / n * 1e6
    agg = Aggregator({"model": a.model})
    records = [StepRecord(events[i % len(events)], 0, ()) for i in range(240)]
    t = time.perf_counter()
    agg.ingest(records)
    msg = json.dumps(agg.update(time.perf_counter()), separators=(",", ":"))
    aggregate_ms = (time.perf_counter() - t) * 1e3

    measured.set()
    srv.stop()
    pool.shutdown(wait=False, cancel_futures=True)
    # Paired too: each open round against the mean of the closed rounds on either side of it,
    # which cancels slow drifts in what else the machine is doing.
    seq = [(r % 2 == 0, x) for r, x in enumerate(
        x for pair in zip(results["open"], results["closed"]) for x in pair)]
    paired = []
    for i, (is_open, x) in enumerate(seq):
        if is_open:
            near = [y for j, (o, y) in enumerate(seq) if not o and abs(j - i) == 1]
            paired.append(x / statistics.mean(near) - 1)
    open_ms = statistics.median(results["open"]) * 1e3
    closed_ms = statistics.median(results["closed"]) * 1e3
    out = {"batch_size": a.batch_size, "rounds": a.rounds, "steps_per_round": a.steps,
           "step_period_open_ms": round(open_ms, 3), "step_period_closed_ms": round(closed_ms, 3),
           "overhead_pct": round((open_ms / closed_ms - 1) * 100, 2),
           "overhead_pct_paired_median": round(statistics.median(paired) * 100, 2),
           "pump_cpu_ms_per_step": round(pump_cpu["cpu_s"] / max(1, pump_cpu["steps"]) * 1e3, 3),
           "pump_cpu_share_of_step_pct": round(pump_cpu["cpu_s"] / max(1, pump_cpu["steps"]) / (open_ms / 1e3) * 100, 4),
           "updates_per_s_open": round(pump_cpu["updates"] / max(1e-9, pump_cpu["wall_s"]), 2),
           "recorder_us_per_step": round(recorder_us, 2), "aggregate_240_steps_ms": round(aggregate_ms, 2),
           "update_bytes_240_steps": len(msg), "rounds_open_ms": [round(x * 1e3, 2) for x in results["open"]],
           "rounds_closed_ms": [round(x * 1e3, 2) for x in results["closed"]]}
    print(json.dumps(out, indent=2))
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
