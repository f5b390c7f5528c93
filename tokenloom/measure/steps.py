"""Step records from the engine's `StepEvent`s: what a benchmark of the real engine and the
simulator both keep of each step.

A token exists when the step that sampled it ends, so per-token times come from the step
events; `StepRecorder` also keeps each step's shape -- how many requests were batched, how
many tokens fed, how long it took and how much of that was the model forward -- the seed's
"batch quality".  The benchmarks (bench/) attach it to the engine, the simulator (sim/)
feeds it the events it makes up.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tokenloom.core.events import StepEvent


@dataclass
class StepRecorder:
    """Observer that keeps per-step shape and per-request token times."""

    token_times: dict[str, list[float]] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)
    forward_times: list[float] = field(default_factory=list)
    num_seqs: list[int] = field(default_factory=list)
    num_decode: list[int] = field(default_factory=list)
    num_batched_tokens: list[int] = field(default_factory=list)
    num_prefill_tokens: list[int] = field(default_factory=list)
    num_waiting: list[int] = field(default_factory=list)
    kv_usage: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    keep_events: bool = False
    events: list[StepEvent] = field(default_factory=list)

    def __call__(self, ev: StepEvent) -> None:
        for e in ev.entries:
            if e.sampled_token_id is not None:  # with speculation, every accepted token arrives now
                self.token_times.setdefault(e.request_id, []).extend(
                    [ev.end_time] * max(1, len(e.generated_token_ids)))
        self.durations.append(ev.duration)
        self.forward_times.append(ev.forward_time)
        self.num_seqs.append(len(ev.entries))
        self.num_decode.append(ev.num_decode)
        self.num_batched_tokens.append(ev.num_batched_tokens)
        self.num_prefill_tokens.append(ev.num_prefill_tokens)
        self.num_waiting.append(ev.num_waiting)
        self.kv_usage.append(ev.kv_blocks_used / ev.kv_blocks_total if ev.kv_blocks_total else math.nan)
        self.num_preemptions += len(ev.preempted)
        if self.keep_events:
            self.events.append(ev)

    def summary(self) -> dict[str, Any]:
        """Step-level figures: how full the batches were and where step time went."""
        n = len(self.durations)
        if n == 0:
            return {"num_steps": 0}
        dur = np.asarray(self.durations)
        fwd = np.asarray(self.forward_times)
        decode_steps = [i for i in range(n) if self.num_prefill_tokens[i] == 0]
        return {
            "num_steps": n,
            "mean_batch_size": float(np.mean(self.num_seqs)),  # requests per step
            "max_batch_size": int(max(self.num_seqs)),
            "mean_decode_batch_size": float(np.mean(self.num_decode)),
            "mean_batched_tokens": float(np.mean(self.num_batched_tokens)),
            "max_batched_tokens": int(max(self.num_batched_tokens)),
            "mixed_or_prefill_steps": n - len(decode_steps),
            "mean_step_ms": float(dur.mean() * 1e3),
            "p95_step_ms": float(np.percentile(dur, 95) * 1e3),
            "mean_decode_only_step_ms": float(dur[decode_steps].mean() * 1e3) if decode_steps else math.nan,
            "mean_forward_ms": float(fwd.mean() * 1e3),
            "engine_overhead_fraction": float(1.0 - fwd.sum() / dur.sum()) if dur.sum() > 0 else math.nan,
            "max_kv_usage": float(np.nanmax(self.kv_usage)) if self.kv_usage else math.nan,
            "num_preemptions": self.num_preemptions,
        }
