"""What a calibration measures: the fixed plan of requests, the engine it runs on, and how
its logged steps become samples for `sim.fit`.

The run itself -- starting `tokenloom serve` (or `LLM`), feeding it the plan with `bench`'s
client, logging every step -- needs the engine and the benchmarks, which stand above the
simulator; it lives in `tokenloom.entrypoints.calibration_run`, and the command that
calibrates hands it to `sim.calibrate` as a `MeasureEngine`.  What both sides must agree
on is here: the plan, the engine's limits, the arrival unit, and the samples' shape.
"""

from __future__ import annotations

import statistics
from typing import Any, Callable, Protocol, Sequence

from tokenloom.sim.fit import Sample
from tokenloom.sim.step_features import Entry, round_up

PlanItem = tuple[str, list[tuple[list[int], int, float]]]  # (name, [(prompt ids, output tokens, arrival)])
StepRow = tuple[list[Entry], float, float, float]  # (entries, start, end, forward) of one logged step

CALIBRATION_MODES = ("serve", "offline")


class MeasureEngine(Protocol):
    """Runs the calibration plan on the real engine: ([(entries, period_s, forward_s)], median gap_s, info).

    mode "serve" measures a real `tokenloom serve` fed over HTTP by a streaming client, "offline"
    runs `LLM.generate` in-process; `neighbors` more busy servers share the machine (serve mode).
    `tokenloom.entrypoints.calibration_run.run_calibration` is the one the commands pass."""

    def __call__(self, model: str, dtype: str = "auto", *, block_size: int = 16, mode: str = "serve",
                 num_threads: int | None = None, neighbors: int = 0, seed: int = 0,
                 log: Callable[[str], None] | None = None) -> tuple[list[Sample], float, dict]: ...


def calibration_plan(vocab: tuple[int, int], max_model_len: int, seed: int = 0) -> list[PlanItem]:
    """Named groups of (prompt token ids, output tokens, arrival), each run as one burst.

    Arrivals are in units of one decode step of the machine (the runner measures it on
    the "decode batch 8" item, which comes first among those that need it), so requests
    join running batches the same way on a slow CPU and on a fast GPU.

    Chosen for a spread of step shapes on an engine with max_num_seqs 16, a 512-token
    budget and prefix caching: decode batches 1..16 at short context, lone prefills of
    8..384 tokens, a long prompt chunked at 512 (a chunk with no logits row, attention
    to ~900 positions), decode batches of 4 and 12 at ~600 tokens of context (their
    prompts share a prefix computed once, so the long contexts cost one prefill), and
    the steps serving is made of: a batch of decodes sharing a step with one new
    prompt (32..400 tokens) or with a long prompt's chunks, at short and long context.
    """
    import numpy as np

    rng = np.random.default_rng([seed, 7])
    lo, hi = vocab

    def prompt(n: int) -> list[int]:
        return rng.integers(lo, hi, size=max(1, min(n, max_model_len - 32))).tolist()

    long_len = max(16, min(900, max_model_len - 16))
    plan: list[PlanItem] = []
    for b in (8, 1, 2, 4, 16):
        plan.append((f"decode batch {b}", [(prompt(24 + i), 9, 0.0) for i in range(b)]))
    for n in (8, 32, 96, 192, 384):
        plan.append((f"prefill {n}", [(prompt(n), 2, 0.0)]))
    plan.append((f"long prompt {long_len} + decode", [(prompt(long_len), 6, 0.0), (prompt(40), 12, 0.0)]))
    prefix_len = max(16, min(600, max_model_len - 40))
    prefix = prompt(prefix_len)
    plan.append((f"shared prefix {prefix_len}", [(prefix, 1, 0.0)]))
    for b, out in ((4, 8), (12, 6)):
        plan.append((f"decode batch {b} at context {prefix_len}", [(prefix + prompt(8), out, 0.0) for _ in range(b)]))
    # Serving's own shape: decodes running while new prompts arrive one at a time.
    arrivals = [(prompt(n), 2, 3.0 + 5.0 * i) for i, n in enumerate((32, 96, 160, 256, 400))]
    plan.append(("8 decoding + prompts of 32..400 arriving",
                 [(prompt(24 + i), 32, 0.0) for i in range(8)] + arrivals))
    plan.append((f"3 decoding at context {prefix_len} + a {long_len}-token prompt arriving",
                 [(prefix + prompt(8), 16, 0.0) for _ in range(3)] + [(prompt(long_len), 2, 3.0)]))
    plan.append(("mixed burst", [(prompt(int(n)), int(o), 0.0) for n, o in
                                 zip(rng.integers(40, 200, size=6), rng.integers(6, 14, size=6))]))
    return plan


def engine_limits(model: str, block_size: int) -> dict:
    """The calibration engine: 16 seats, a 512-token budget, prefix caching, KV for 16 full requests."""
    from tokenloom.specs.model_spec import load_model_shape

    max_model_len = min(2048, load_model_shape(model).max_position_embeddings)
    return dict(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=max_model_len, block_size=block_size,
                num_kv_blocks=16 * round_up(max_model_len, block_size) // block_size, enable_prefix_caching=True)


def samples_from(runs: Sequence[Sequence[StepRow]]) -> tuple[list[Sample], float]:
    """(entries, start, end, forward) per step, grouped by run -> samples with the median loop gap added."""
    gaps = [b[1] - a[2] for evs in runs for a, b in zip(evs, evs[1:])]
    gap = statistics.median(gaps) if gaps else 0.0
    return [(entries, end - start + gap, fwd) for evs in runs for entries, start, end, fwd in evs], gap


def decode_step_s(rows: Sequence[StepRow]) -> float:
    """Median period of the decode-only steps among `rows` (the plan's arrival unit)."""
    periods = [end - start for entries, start, end, _ in rows
               if entries and all(n == 1 and c > 0 for n, c, _ in entries)]
    return statistics.median(periods) if periods else 0.1


def event_row(ev: Any) -> StepRow:
    """A `StepEvent` as the row a calibration logs: each entry's (tokens, KV before, sampled?) and the times."""
    entries = [(e.num_tokens, e.kv_len_before, e.sampled_token_id is not None) for e in ev.entries]
    return entries, ev.start_time, ev.end_time, ev.forward_time


def engine_decode_reads_blocks_in_place() -> bool:
    """Whether the engine, on this machine's default device, runs our paged decode attention."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.weights.loader import resolve_device

    return resolve_device("auto").type == "cpu" and cpu_kernels.attention_enabled()
