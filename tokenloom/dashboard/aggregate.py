"""Aggregator: step records in, one compact dashboard update out.

Runs on the event loop, at most a few times a second, over whatever steps the engine ran
since the previous update.  It keeps just enough per-request state to name rows and to
time tokens:

    row          a small integer per request, so a step lists [row, kind, tokens] and not
                 40-character ids (the page draws rows = requests, columns = steps)
    kind         0 decode, 1 prefill chunk (prompt not finished), 2 prefill that reached the
                 end of the prompt (it samples the first token), 3 recompute after preemption
    TTFT         first sampled token's step end - arrival
    ITL          gap between two tokens of one request (spread over the tokens of a step
                 that produced several, e.g. with speculative decoding)
    TPOT         (last token - first token) / (tokens - 1), once a request finishes

Latencies are kept in a sliding window (`window_s`) and reported as P50 / P95.
Pure Python, no engine, no asyncio, no HTTP: the tests feed it records directly too.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from tokenloom.dashboard.recorder import StepRecord

DECODE, CHUNK, PREFILL, RECOMPUTE = 0, 1, 2, 3


def percentile(sorted_values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100) of an ascending sequence; None when empty."""
    if not sorted_values:
        return None
    k = max(0, math.ceil(q / 100 * len(sorted_values)) - 1)
    return sorted_values[min(k, len(sorted_values) - 1)]


def tokens_out(entry: Any) -> int:
    """Tokens an entry's request gained this step.  Read defensively (older events lack the
    field): a speculative decode lists every token it appended (accepted drafts, then the
    sampled one) in `generated_token_ids`; a plain step samples at most one."""
    many = getattr(entry, "generated_token_ids", None)
    if many:
        return len(many)
    return 0 if getattr(entry, "sampled_token_id", None) is None else 1


class LatencyWindow:
    """(time, seconds) samples of the last `window_s` seconds, at most `max_samples`."""

    def __init__(self, window_s: float, max_samples: int = 8192):
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, t: float, value: float) -> None:
        self._samples.append((t, max(0.0, value)))

    def summary(self, now: float) -> dict[str, float | int | None]:
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        vals = sorted(v for _, v in self._samples)
        return {"p50": percentile(vals, 50), "p95": percentile(vals, 95), "n": len(vals)}


@dataclass
class _Req:
    row: int
    request_id: str
    prompt_tokens: int
    arrival: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    num_out: int = 0
    last_seen: float = 0.0


class Aggregator:
    """Accumulates records between updates; `update()` returns the next message."""

    def __init__(self, config: dict[str, Any], *, window_s: float = 30.0, max_steps_per_update: int = 240,
                 forget_after_s: float = 120.0):
        self.config = config  # static facts for the page: model, budget, KV total, ...
        self.window_s = window_s
        self.max_steps_per_update = max_steps_per_update
        self.forget_after_s = forget_after_s  # a request not seen this long (aborted) is dropped
        self.t0: float | None = None  # start_clock's time (else the first step's start): times are relative to it
        self.ttft = LatencyWindow(window_s)
        self.tpot = LatencyWindow(window_s)
        self.itl = LatencyWindow(window_s)
        self._reqs: dict[str, _Req] = {}
        self._next_row = 0
        self._arrivals: dict[str, float] = {}
        self.steps_total = 0
        self.preemptions_total = 0
        self.generated_total = 0
        self.seq = 0
        self._last_time: float | None = None
        self._pending_steps: list[list[Any]] = []
        self._new_rows: list[list[Any]] = []
        self._done_rows: list[list[Any]] = []
        self._gen = self._prefill = self._decode = self._preempt = self._nsteps = 0
        self._state: dict[str, Any] = {"running": 0, "waiting": 0, "kv_used": 0, "kv_total": 0, "kv_cached": 0,
                                       "last_step": None}

    # ---- ingest ----------------------------------------------------------
    def ingest(self, records: Iterable[StepRecord]) -> None:
        for rec in records:
            self._ingest_one(rec)

    def _ingest_one(self, rec: StepRecord) -> None:
        ev = rec.event
        if self.t0 is None:
            self.t0 = ev.start_time
        for rid, arrival in rec.arrivals:
            self._arrivals[rid] = arrival
        end = ev.end_time
        cells: list[list[int]] = []
        decode_tokens = prefill_tokens = 0
        for e in ev.entries:
            req = self._reqs.get(e.request_id)
            if req is None:
                req = self._new_request(e.request_id, e.num_prompt_tokens)
            req.last_seen = end
            if req.arrival is None:
                req.arrival = self._arrivals.pop(e.request_id, None)
            n = int(e.num_tokens)
            if e.phase == "decode":
                kind = DECODE
                decode_tokens += n
            else:
                prefill_tokens += n
                if req.num_out or e.kv_len_after > e.num_prompt_tokens:
                    kind = RECOMPUTE
                elif e.kv_len_after >= e.num_prompt_tokens:
                    kind = PREFILL
                else:
                    kind = CHUNK
            cells.append([req.row, kind, n])
            got = tokens_out(e)
            if got:
                self._on_tokens(req, got, end)
            if e.finished:
                self._finish(req, e.finish_reason)
        self.steps_total += 1
        self._nsteps += 1
        self._decode += decode_tokens
        self._prefill += prefill_tokens
        self._preempt += len(ev.preempted)
        self.preemptions_total += len(ev.preempted)
        t = self._rel(ev.start_time)
        self._pending_steps.append([ev.step, round(t, 4), round(ev.duration * 1e3, 3), decode_tokens,
                                    prefill_tokens, cells, len(ev.preempted)])
        if len(self._pending_steps) > self.max_steps_per_update:
            del self._pending_steps[0]
        kv_total = ev.kv_blocks_total
        self._state.update(running=ev.num_running, waiting=ev.num_waiting, kv_used=ev.kv_blocks_used,
                           kv_total=kv_total, kv_cached=min(rec.kv_blocks_cached, kv_total or rec.kv_blocks_cached),
                           last_step=ev.step)

    def _rel(self, t: float) -> float:
        return t - (self.t0 or 0.0)

    def _new_request(self, request_id: str, prompt_tokens: int) -> _Req:
        req = _Req(self._next_row, request_id, int(prompt_tokens))
        self._next_row += 1
        self._reqs[request_id] = req
        self._new_rows.append(self._row_info(req))
        return req

    def _row_info(self, req: _Req) -> list[Any]:
        return [req.row, req.request_id, req.prompt_tokens]

    def _on_tokens(self, req: _Req, n: int, t: float) -> None:
        self._gen += n
        self.generated_total += n
        if req.first_token is None:
            req.first_token = t
            if req.arrival is not None:
                self.ttft.add(t, t - req.arrival)
        elif req.last_token is not None:
            gap = (t - req.last_token) / n
            for _ in range(n):
                self.itl.add(t, gap)
        req.last_token = t
        req.num_out += n

    def _finish(self, req: _Req, reason: str | None) -> None:
        if req.first_token is not None and req.last_token is not None and req.num_out > 1:
            self.tpot.add(req.last_token, (req.last_token - req.first_token) / (req.num_out - 1))
        self._done_rows.append([req.row, reason or "finished"])
        self._reqs.pop(req.request_id, None)

    # ---- emit ------------------------------------------------------------
    def active_rows(self) -> list[list[Any]]:
        """Rows of requests still in flight (what a newly opened page needs to name them)."""
        return [self._row_info(r) for r in sorted(self._reqs.values(), key=lambda r: r.row)]

    def start_clock(self, now: float) -> None:
        """The first update's rates count from `now` (when the page opened), and so do times."""
        self._last_time = now
        if self.t0 is None:
            self.t0 = now

    def has_news(self) -> bool:
        return bool(self._nsteps or self._new_rows or self._done_rows)

    def update(self, now: float) -> dict[str, Any]:
        """The message for the steps ingested since the previous call; `now` on the engine's clock."""
        interval = (now - self._last_time) if self._last_time is not None else None
        self._last_time = now
        for rid in [r.request_id for r in self._reqs.values() if now - r.last_seen > self.forget_after_s]:
            req = self._reqs.pop(rid)
            self._done_rows.append([req.row, "gone"])
        if len(self._arrivals) > 4096:  # arrivals of requests never seen in a step (aborted early)
            self._arrivals.clear()

        def rate(n: int) -> float:
            return round(n / interval, 2) if interval else 0.0

        s = self._state
        kv_total = s["kv_total"]
        self.seq += 1
        msg = {
            "seq": self.seq,
            "time": round(self._rel(now), 4) if self.t0 is not None else 0.0,
            "interval": round(interval, 4) if interval else None,
            "config": self.config,
            "steps_in_update": self._nsteps,
            "steps_total": self.steps_total,
            "last_step": s["last_step"],
            "steps": self._pending_steps,
            "rows_new": self._new_rows,
            "rows_done": self._done_rows,
            "running": s["running"],
            "waiting": s["waiting"],
            "kv": {"used": s["kv_used"], "cached": s["kv_cached"], "free": max(0, kv_total - s["kv_used"]),
                   "total": kv_total},
            "preemptions": {"new": self._preempt, "total": self.preemptions_total},
            "tokens": {"generated": self._gen, "prefill": self._prefill, "decode": self._decode},
            "tokens_per_s": {"generated": rate(self._gen), "prefill": rate(self._prefill),
                             "decode": rate(self._decode)},
            "latency": {"window_s": self.window_s, "ttft": self.ttft.summary(now), "tpot": self.tpot.summary(now),
                        "itl": self.itl.summary(now)},
        }
        self._pending_steps, self._new_rows, self._done_rows = [], [], []
        self._gen = self._prefill = self._decode = self._preempt = self._nsteps = 0
        return msg
