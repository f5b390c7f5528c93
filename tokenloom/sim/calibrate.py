"""Calibration: the cost model fitted to *this engine on this machine*.

`estimate.CostModel` times a step as `max(bytes / bandwidth, FLOPs / peak) + overhead`
with datasheet (or microbenchmark) rates -- the right shape for a GPU running fused
kernels.  To predict what `tokenloom serve` really does on `--hardware local`, four
things the plain roofline leaves out are modelled, and the rates are the ones our
eager PyTorch forward pass actually reaches, fitted to its real steps:

1. **Two matmul rooflines, not one.**  Every step runs the decoder layers over all T
   new tokens, but the vocabulary projection only over the S rows that sample a token
   (the last position of each request that catches up this step).  Each is its own
   GEMM with its own arithmetic intensity, so each gets its own roofline::

       layers:  combine(W_layers / bw,  2 * P_layers * T / F)
       logits:  combine(W_head   / bw,  2 * P_head   * S / F)     (0 when S = 0)

   A 256-token prefill chunk is compute-bound in the layers yet memory-bound in the
   head (one row reads the whole vocab matrix: 27% of Qwen2.5-0.5B's weights); one
   roofline over the whole step would hide that read.  A chunk that stops short of the
   prompt's end samples nothing and skips the head altogether.

   A GEMM over few rows also runs below the rate one over many rows reaches (each
   weight loaded feeds fewer FMAs, and fixed per-call costs weigh more), so the
   calibrated rate depends on the row count r of each GEMM::

       F(r) = F * r / (r + r_half)

   with r_half fitted too (0: one rate for every shape).  Without it one F has to
   serve both 8-row decode steps and 256-row prefills, and misses both.

2. **Overlap is measured, not assumed.**  `combine` is `max` when streaming the weights
   and computing overlap (a GPU: separate memory system, thousands of threads) and
   `sum` when they do not (a CPU, where the same two cores load the weights and do the
   FLOPs).  The fit tries both and keeps the one that explains the steps better.

3. **Padded attention.**  The model runner gathers each request's KV blocks into a
   dense `[rows, L_max]` tensor (L_max = the longest block table in the group, in
   whole blocks) and runs one masked attention for the decodes and one for the
   prefill chunks (queries padded to the longest chunk).  So attention costs
   `padded query x key pairs x 4 * layers * heads * head_dim` FLOPs at a rate F_attn,
   plus moving the KV of `rows x L_max` gathered positions (`kv_bytes_per_token` each)
   at a rate G -- its own rate, because the gather copies it and grouped-query
   attention may expand it to every query head before the kernel reads it.  New K/V
   (`T x kv_bytes_per_token`) is written at bw.

4. **Fixed costs.**  Eager PyTorch pays a dispatch cost per op: `dispatch` = the
   microbenchmarked per-op time x the model's op count (`ModelSpec.eager_ops_per_step`).
   Outside the model, the engine's Python -- scheduling, input preparation, sampling,
   detokenizing, stop checks, the loop between steps -- costs `o` per step plus
   `o_seq` per scheduled request.

So, for one step of N requests::

    forward = dispatch + layers + logits + A_flops / F_attn + gathered_KV_bytes / G + new_KV_bytes / bw
    t       = forward + o + o_seq * N

Measuring.  `run_calibration` runs the real engine over a fixed plan of requests chosen
to produce a spread of step shapes -- decode batches of 1 to 16, single prefills of 8
to 384 tokens, a long prompt chunked at 512 tokens (chunks with and without a logits
row, attention at 500-900 positions), decode batches at ~600 tokens of context, a
mixed burst -- and records every `StepEvent`, which carries both the step's duration
and the model's share of it (`forward_time`).  By default ("serve" mode) it measures
the engine as `bench serve` uses it: a real `tokenloom serve` process fed over HTTP by
a streaming client, because on a machine with few cores the server's event loop and
the client take CPU from the forward pass (on this 2-core machine the served steps
are ~30% slower than `LLM.generate`'s); "offline" mode runs `LLM.generate` in this
process, for predicting offline benchmarks.

Fitting.  The two parts are fitted separately, so nothing constant has to be split
between them by guesswork:

* `o`, `o_seq`: least squares on the engine's own time per step (duration - forward
  time + the median gap between steps) against N.
* bw, F, F_attn, G and `combine`: the forward times, by a log grid over bw and F
  around the microbenchmark figures (`tokenloom.specs.microbench`) with 1/F_attn and 1/G
  solved at each point (non-negative least squares), minimising the squared
  *relative* error (a 250 ms decode step matters as much as a 4 s prefill); both
  `combine`s, best wins.  On a shared
  machine a few steps are slowed by other processes: the fit is repeated without the
  steps it missed by far (see `fit`).

The result -- fitted rates, their ratio to the microbenchmarks, the fit's error and the
raw step samples -- is cached as JSON next to the microbenchmark cache, keyed by the
machine (CPU, threads, torch), the model's shape, the dtype, the block size and a hash
of the engine's hot-path source files, so editing the engine invalidates it.

    cm = calibrated_cost_model("/tmp/m/qwen2.5-0.5b")     # measures once (~1-2 min), then cached
    Simulator(cm, SimConfig(...)).run(requests)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

from tokenloom.sim.estimate import CostModel, StepCost
from tokenloom.specs.hardware import Hardware
from tokenloom.specs.model_spec import ModelSpec, load_model_spec, normalize_dtype

CALIBRATION_VERSION = 2
_CACHE_FILE = "calibration.json"

# One scheduled request in a step: (new tokens, tokens already in its KV cache, samples a token).
Entry = tuple[int, int, bool]

# The engine's step: the sources in these packages decide how long it takes.  Their hash is
# part of the cache key, so a calibration never outlives the code it measured.
_HOT_PATH = ("core", "engine", "model", "runner", "entrypoints/openai", "kernels")


# ---------------------------------------------------------------- step features
@dataclass(frozen=True)
class StepParts:
    """A step's work before any rate is applied (see the module docstring)."""

    num_seqs: int
    num_tokens: int
    num_sampled: int
    layer_bytes: float
    layer_flops: float
    head_bytes: float  # 0 when no row samples
    head_flops: float
    attn_flops: float  # padded query x key pairs x attention FLOPs per pair
    gather_bytes: float  # KV of the padded positions gathered for attention
    kv_write_bytes: float  # new K/V written into the cache


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


class StepFeatures:
    """Turns step entries into `StepParts` for one model, dtype and block size."""

    def __init__(self, spec: ModelSpec, dtype: str, block_size: int = 16, paged_decode: bool = False) -> None:
        nb = {"float16": 2, "bfloat16": 2, "float32": 4}[normalize_dtype(dtype)]
        self.block_size = block_size
        # True where decode attention reads each request's blocks in place (our CPU kernel):
        # its work is the actual context, not the group's padded, gathered length.
        self.paged_decode = paged_decode
        streamed = spec.streamed_weight_bytes(dtype)
        self.head_bytes = spec.logits_matmul_params * nb
        # Norms and biases travel with the layers; the vocab matrix is the head's.
        self.layer_bytes = streamed - self.head_bytes
        self.layer_flops_per_token = 2 * spec.layer_matmul_params
        self.head_flops_per_row = 2 * spec.logits_matmul_params
        self.attn_flops_per_pair = spec.attention_flops_per_position
        self.kv_bytes_per_token = spec.kv_bytes_per_token(dtype)

    def parts(self, entries: Sequence[Entry]) -> StepParts:
        bs = self.block_size
        tokens = sampled = 0
        dec_rows = dec_len = dec_in_place = 0
        pre_rows = pre_q = pre_len = 0
        for n, c, s in entries:
            tokens += n
            sampled += bool(s)
            if n == 1 and c > 0:  # a decode (or a one-token chunk after a cached prefix: same work)
                if self.paged_decode:
                    dec_in_place += c + 1
                    continue
                dec_rows += 1
                dec_len = max(dec_len, _round_up(c + 1, bs))
            else:
                pre_rows += 1
                pre_q = max(pre_q, n)
                pre_len = max(pre_len, _round_up(c + n, bs))
        pairs = dec_in_place + dec_rows * dec_len + pre_rows * pre_q * pre_len
        gathered = dec_in_place + dec_rows * dec_len + pre_rows * pre_len
        return StepParts(
            num_seqs=len(entries),
            num_tokens=tokens,
            num_sampled=sampled,
            layer_bytes=float(self.layer_bytes) if entries else 0.0,
            layer_flops=float(tokens * self.layer_flops_per_token),
            head_bytes=float(self.head_bytes) if sampled else 0.0,
            head_flops=float(sampled * self.head_flops_per_row),
            attn_flops=float(pairs * self.attn_flops_per_pair),
            gather_bytes=float(gathered * self.kv_bytes_per_token),
            kv_write_bytes=float(tokens * self.kv_bytes_per_token),
        )


# ---------------------------------------------------------------- the calibrated parameters
@dataclass(frozen=True)
class Calibration:
    """Fitted rates and overheads of this engine on this machine (plus how well they fit)."""

    bandwidth: float  # B/s the weight streaming achieves
    flop_rate: float  # FLOP/s the GEMMs approach over many rows
    attn_flop_rate: float  # FLOP/s of the padded attention (math.inf: no measurable cost)
    gather_rate: float  # B/s at which attention moves the gathered KV (math.inf: no measurable cost)
    overhead_s: float  # engine Python per step, outside the model (incl. the loop between steps)
    per_seq_overhead_s: float  # engine Python per scheduled request: sampling, detokenizing, bookkeeping
    overlap: str = "max"  # how memory and compute time combine: "max" (overlap) or "sum" (none)
    gemm_half_rows: float = 0.0  # r_half: a GEMM over r rows runs at flop_rate * r / (r + r_half)
    dispatch_s: float = 0.0  # eager op dispatch per forward (microbench per-op time x ops)
    block_size: int = 16
    paged_decode: bool = False  # decode attention read the blocks in place (StepFeatures)
    # Fit quality on the calibration steps: relative errors |pred - real| / real of whole steps.
    num_steps: int = 0
    num_dropped: int = 0  # calibration steps left out of the fit as disturbed (see `fit`)
    median_abs_rel_error: float = math.nan
    p90_abs_rel_error: float = math.nan
    max_abs_rel_error: float = math.nan
    other_overlap_error: float = math.nan  # median |error| of the best fit with the other `overlap`
    # References: the microbenchmarks of the same machine, and what the fit is relative to them.
    microbench_bandwidth: float = math.nan
    microbench_flop_rate: float = math.nan
    step_gap_s: float = 0.0  # median time between one step's end and the next one's start (in overhead_s)
    mode: str = "serve"  # how the steps were measured: "serve" (HTTP server + client) or "offline"
    key: str = ""
    measured_at: str = ""
    model: str = ""
    dtype: str = ""
    calibration_wall_s: float = math.nan
    # {"entries": [[n, c, sample], ...], "period_s": step + gap, "forward_s": model time}
    samples: list[dict] = field(default_factory=list)

    @property
    def mem_efficiency(self) -> float:
        return self.bandwidth / self.microbench_bandwidth

    @property
    def compute_efficiency(self) -> float:
        return self.flop_rate / self.microbench_flop_rate

    def to_dict(self, with_samples: bool = True) -> dict:
        d = asdict(self)
        if not with_samples:
            d.pop("samples")
        for k, v in d.items():
            if isinstance(v, float) and not math.isfinite(v):
                d[k] = None  # JSON has no inf/nan
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "Calibration":
        kw = {k: d[k] for k in cls.__dataclass_fields__ if k in d}
        for k in ("attn_flop_rate", "gather_rate"):
            if kw.get(k) is None:
                kw[k] = math.inf
        for k in ("median_abs_rel_error", "p90_abs_rel_error", "max_abs_rel_error", "other_overlap_error",
                  "microbench_bandwidth", "microbench_flop_rate", "calibration_wall_s"):
            if kw.get(k) is None:
                kw[k] = math.nan
        return cls(**kw)

    def summary_lines(self) -> list[str]:
        attn = "negligible" if math.isinf(self.attn_flop_rate) else f"{self.attn_flop_rate / 1e9:.1f} GFLOP/s"
        gather = "negligible" if math.isinf(self.gather_rate) else f"{self.gather_rate / 1e9:.2f} GB/s"
        other = "max" if self.overlap == "sum" else "sum"
        return [
            f"weight streaming {self.bandwidth / 1e9:.2f} GB/s ({self.mem_efficiency:.2f} x microbench copy "
            f"{self.microbench_bandwidth / 1e9:.2f} GB/s)",
            f"GEMMs {self.flop_rate / 1e9:.1f} GFLOP/s over many rows ({self.compute_efficiency:.2f} x microbench "
            f"matmul {self.microbench_flop_rate / 1e9:.1f} GFLOP/s), half that at {self.gemm_half_rows:g} rows; "
            f"padded attention {attn}, KV gather {gather}",
            f"memory and compute combine by {self.overlap} (the best fit with {other} misses by "
            f"{100 * self.other_overlap_error:.1f}% median)",
            f"op dispatch {self.dispatch_s * 1e3:.2f} ms/forward; engine {self.overhead_s * 1e3:.2f} ms/step "
            f"(loop gap {self.step_gap_s * 1e3:.2f} ms) + {self.per_seq_overhead_s * 1e3:.3f} ms/request",
            f"fit on {self.num_steps} engine steps measured {'through the server' if self.mode == 'serve' else 'offline'} "
            f"({self.num_dropped} more dropped as disturbed): "
            f"median |error| {100 * self.median_abs_rel_error:.1f}%, "
            f"p90 {100 * self.p90_abs_rel_error:.1f}%, max {100 * self.max_abs_rel_error:.1f}%",
        ]


def _combine(overlap: str, mem_t, comp_t):
    """Memory and compute time of one GEMM: overlapped (max) or not (sum); works on numpy arrays too."""
    if overlap == "sum":
        return mem_t + comp_t
    import numpy as np

    return np.maximum(mem_t, comp_t)


# ---------------------------------------------------------------- the cost model
class EngineCostModel(CostModel):
    """`CostModel` with the calibrated step formula (module docstring) and rates.

    `step_time(prefill, decode)` keeps the parent's interface (each prefill entry is
    assumed to sample, as the parent assumes); the simulator calls
    `scheduled_step_time(out)` instead, which knows which entries really sample.
    """

    def __init__(self, spec: ModelSpec, hardware: Hardware, dtype: str | None, calibration: Calibration) -> None:
        super().__init__(spec, hardware, dtype, mem_efficiency=1.0, compute_efficiency=1.0,
                         overhead_s=calibration.overhead_s + calibration.dispatch_s,
                         per_seq_overhead_s=calibration.per_seq_overhead_s)
        self.calibration = calibration
        # The fitted rates replace the parent's peak x efficiency.
        self.bandwidth = calibration.bandwidth
        self.flop_rate = calibration.flop_rate
        self.attn_flop_rate = calibration.attn_flop_rate
        self.mem_efficiency = calibration.bandwidth / hardware.mem_bandwidth
        self.compute_efficiency = calibration.flop_rate / hardware.flops_for(self.dtype)
        self.features = StepFeatures(spec, self.dtype, calibration.block_size, calibration.paged_decode)

    def entries_cost(self, entries: Sequence[Entry]) -> StepCost:
        if not entries:
            return StepCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
        p = self.features.parts(entries)
        cal = self.calibration
        forward = _forward_time(cal, p)
        over = cal.overhead_s + cal.per_seq_overhead_s * p.num_seqs
        nbytes = p.layer_bytes + p.head_bytes + p.gather_bytes + p.kv_write_bytes
        flops = p.layer_flops + p.head_flops + p.attn_flops
        return StepCost(nbytes, flops, nbytes / cal.bandwidth, flops / cal.flop_rate, over + cal.dispatch_s,
                        forward + over)

    def step_cost(self, prefill: Sequence[tuple[int, int]], decode_context_lens: Sequence[int]) -> StepCost:
        entries = [(1, c, True) for c in decode_context_lens] + [(n, c, True) for n, c in prefill]
        return self.entries_cost(entries)

    def decode_cost(self, batch_size: int, context_len: int) -> StepCost:
        return self.step_cost([], [context_len] * batch_size)

    def scheduled_step_time(self, out: Any) -> float:
        """Seconds for a `SchedulerOutput`: entries with their real sample flags."""
        return self.entries_cost([(s.num_new_tokens, s.num_computed_before, bool(s.sample))
                                  for s in out.scheduled]).time_s


def _rows_factor(rows, half_rows: float):
    """(r + r_half) / r: how much slower than `flop_rate` a GEMM over r rows runs (arrays too)."""
    return (rows + half_rows) / max(rows, 1) if half_rows else 1.0


def _forward_time(cal: Calibration, p: StepParts) -> float:
    bw, F, h = cal.bandwidth, cal.flop_rate, cal.gemm_half_rows
    t = float(_combine(cal.overlap, p.layer_bytes / bw, p.layer_flops / F * _rows_factor(p.num_tokens, h)))
    if p.num_sampled:
        t += float(_combine(cal.overlap, p.head_bytes / bw, p.head_flops / F * _rows_factor(p.num_sampled, h)))
    return (t + p.attn_flops / cal.attn_flop_rate + p.gather_bytes / cal.gather_rate + p.kv_write_bytes / bw
            + cal.dispatch_s)


def _predict(cal: Calibration, features: StepFeatures, entries_list: Iterable[Sequence[Entry]]) -> list[float]:
    """Whole-step seconds (forward + engine overhead) for each step."""
    out = []
    for entries in entries_list:
        p = features.parts(entries)
        out.append(_forward_time(cal, p) + cal.overhead_s + cal.per_seq_overhead_s * p.num_seqs)
    return out


# ---------------------------------------------------------------- fitting
Sample = tuple[Sequence[Entry], float, float]  # (entries, step period s, model forward s)


def fit(samples: Sequence[Sample], features: StepFeatures, *, bandwidth_ref: float, flop_rate_ref: float,
        dispatch_s: float = 0.0, trim: bool = True, overlaps: Sequence[str] = ("max", "sum"),
        **grid_kw: Any) -> Calibration:
    """Fit the engine overhead (o, o_seq) and the forward pass (bw, F, F_attn, overlap).

    `samples`: (entries, step period, forward time) per measured step.  The forward fit
    minimizes the sum of squared relative errors.  With `trim` it is done twice, the
    second time without the steps the first fit missed by more than 3x its median
    error (never more than 20% of them, never one within 5%): on a shared machine a few
    steps are slowed by other processes.  Reported errors are those of whole steps
    (forward + overhead) over the steps kept; `num_dropped` says how many were not.
    """
    import numpy as np

    if not samples:
        raise ValueError("no calibration steps to fit")
    # 1) the engine's own time: period - forward = o + o_seq * N.
    n_seq = np.array([len(e) for e, _, _ in samples], dtype=float)
    y_eng = np.array([max(0.0, t - f) for _, t, f in samples])
    A = np.stack([np.ones_like(n_seq), n_seq], axis=1)
    (o, o_seq), _ = _nnls_small(A, y_eng)
    # 2) the forward pass, for each way memory and compute may combine.
    kept = list(samples)
    fits = [_fit_forward(kept, features, bandwidth_ref, flop_rate_ref, dispatch_s, ov, **grid_kw) for ov in overlaps]
    if trim and len(samples) >= 10:
        best = min(fits, key=lambda c: c[1])[0]
        kept = [samples[i] for i in _kept(samples, features, best)]
        if len(kept) < len(samples):
            fits = [_fit_forward(kept, features, bandwidth_ref, flop_rate_ref, dispatch_s, ov, **grid_kw)
                    for ov in overlaps]
    ranked = sorted(fits, key=lambda c: c[1])
    cal = _replace(ranked[0][0], overhead_s=float(o), per_seq_overhead_s=float(o_seq),
                   num_dropped=len(samples) - len(kept))
    y = np.array([t for _, t, _ in kept])
    errs = np.abs(np.array(_predict(cal, features, [e for e, _, _ in kept])) - y) / y
    other = math.nan
    if len(ranked) > 1:
        oc = _replace(ranked[1][0], overhead_s=float(o), per_seq_overhead_s=float(o_seq))
        other = float(np.median(np.abs(np.array(_predict(oc, features, [e for e, _, _ in kept])) - y) / y))
    return _replace(cal, num_steps=len(kept), median_abs_rel_error=float(np.median(errs)),
                    p90_abs_rel_error=float(np.percentile(errs, 90)), max_abs_rel_error=float(errs.max()),
                    other_overlap_error=other)


def _kept(samples: Sequence[Sample], features: StepFeatures, cal: Calibration) -> list[int]:
    """Indices of the steps whose forward time `cal` explains (see `fit`)."""
    import numpy as np

    yf = np.array([f for _, _, f in samples])
    pf = np.array([_forward_time(cal, features.parts(e)) for e, _, _ in samples])
    errs = np.abs(pf - yf) / yf
    cut = max(3 * float(np.median(errs)), float(np.percentile(errs, 80)), 0.05)  # within 5% is never noise
    return [i for i, e in enumerate(errs) if e <= cut]


def _nnls_small(A, b):
    """min ||A x - b|| with x >= 0, for a handful of columns: try every active set."""
    import itertools

    import numpy as np

    k = A.shape[1]
    best_x, best_r = np.zeros(k), float(b @ b)
    for r in range(1, k + 1):
        for cols in itertools.combinations(range(k), r):
            sub = A[:, cols]
            x, *_ = np.linalg.lstsq(sub, b, rcond=None)
            if (x < 0).any():
                continue
            res = b - sub @ x
            rr = float(res @ res)
            if rr < best_r:
                best_r = rr
                best_x = np.zeros(k)
                best_x[list(cols)] = x
    return best_x, best_r


# r_half candidates: 0 (one rate) up to the row count where decode batches live.
HALF_ROWS_GRID = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)


def _fit_forward(samples: Sequence[Sample], features: StepFeatures, bandwidth_ref: float, flop_rate_ref: float,
                 dispatch_s: float, overlap: str, half_rows: Sequence[float] = HALF_ROWS_GRID,
                 **grid_kw: Any) -> tuple[Calibration, float]:
    """(calibration, loss): the best of `_fit_rates` over the r_half candidates.

    Only where memory and compute overlap: summed, F(r)'s extra time per GEMM,
    2 * params * r_half / F, is a constant per step, exactly like the weight read, so the
    data cannot tell r_half from a lower bandwidth; r_half stays 0 there."""
    if overlap == "sum":
        half_rows = (0.0,)
    fits = [_fit_rates(samples, features, bandwidth_ref, flop_rate_ref, dispatch_s, overlap, h, **grid_kw)
            for h in half_rows]
    return min(fits, key=lambda c: c[1])


def _fit_rates(samples: Sequence[Sample], features: StepFeatures, bandwidth_ref: float, flop_rate_ref: float,
               dispatch_s: float, overlap: str, half_rows: float, grid: int = 32, lo: float = 0.01,
               hi: float = 3.0, rounds: int = 3) -> tuple[Calibration, float]:
    """(calibration, loss) for one r_half: log grid over bw and F, zoomed `rounds` times;
    1/F_attn and 1/G by NNLS."""
    import numpy as np

    if overlap not in ("max", "sum"):
        raise ValueError(f"overlap must be 'max' or 'sum', got {overlap!r}")
    parts = [features.parts(e) for e, _, _ in samples]
    y = np.array([f for _, _, f in samples], dtype=float)
    if (y <= 0).any():
        raise ValueError("forward times must be > 0")
    w = 1.0 / y
    lb = np.array([p.layer_bytes for p in parts])
    # FLOPs already scaled by the row-count slowdown, so each grid point only divides by F.
    lf = np.array([p.layer_flops * _rows_factor(p.num_tokens, half_rows) for p in parts])
    hb = np.array([p.head_bytes for p in parts])
    hf = np.array([p.head_flops * _rows_factor(p.num_sampled, half_rows) for p in parts])
    has_head = np.array([p.num_sampled > 0 for p in parts])
    kvw = np.array([p.kv_write_bytes for p in parts])
    # Linear, non-negative: 1/F_attn x attention FLOPs + 1/G x gathered KV bytes (columns scaled to ~1).
    M = np.stack([np.array([p.attn_flops for p in parts]), np.array([p.gather_bytes for p in parts])], axis=1)
    scale = np.maximum(M.max(axis=0), 1e-30)
    Mw = (M / scale) * w[:, None]

    def solve(bw: float, F: float) -> tuple[float, np.ndarray]:
        base = (_combine(overlap, lb / bw, lf / F) + np.where(has_head, _combine(overlap, hb / bw, hf / F), 0.0)
                + kvw / bw + dispatch_s)
        x, loss = _nnls_small(Mw, (y - base) * w)
        return loss, x / scale

    best = None
    blo, bhi = bandwidth_ref * lo, bandwidth_ref * hi
    flo, fhi = flop_rate_ref * lo, flop_rate_ref * hi
    for _ in range(rounds):
        for bw in np.geomspace(blo, bhi, grid):
            for F in np.geomspace(flo, fhi, grid):
                loss, x = solve(bw, F)
                if best is None or loss < best[0]:
                    best = (loss, bw, F, x)
        _, bw, F, _ = best
        # Zoom: +-2 grid cells around the best point.
        step_b = (bhi / blo) ** (2.0 / (grid - 1))
        step_f = (fhi / flo) ** (2.0 / (grid - 1))
        blo, bhi, flo, fhi = bw / step_b, bw * step_b, F / step_f, F * step_f
    loss, bw, F, (inv_attn, inv_gather) = best
    cal = Calibration(bandwidth=float(bw), flop_rate=float(F),
                      attn_flop_rate=math.inf if inv_attn <= 0 else float(1.0 / inv_attn),
                      gather_rate=math.inf if inv_gather <= 0 else float(1.0 / inv_gather),
                      overhead_s=0.0, per_seq_overhead_s=0.0, overlap=overlap, gemm_half_rows=float(half_rows),
                      dispatch_s=float(dispatch_s), block_size=features.block_size, microbench_bandwidth=float(bandwidth_ref),
                      microbench_flop_rate=float(flop_rate_ref))
    return cal, loss


def _replace(cal: Calibration, **kw: Any) -> Calibration:
    import dataclasses

    return dataclasses.replace(cal, **kw)


# ---------------------------------------------------------------- measuring the engine
PlanItem = tuple[str, list[tuple[list[int], int, float]]]  # (name, [(prompt ids, output tokens, arrival)])


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


def _requests(items: Sequence[tuple[list[int], int, float]], step_s: float) -> list:
    from tokenloom.bench.workloads import BenchRequest

    return [BenchRequest(p, o, arrival_time=a * step_s) for p, o, a in items]


CALIBRATION_MODES = ("serve", "offline")


def _engine_limits(model: str, block_size: int) -> dict:
    """The calibration engine: 16 seats, a 512-token budget, prefix caching, KV for 16 full requests."""
    max_len_cfg = int(load_config_dict(model).get("max_position_embeddings") or 2048)
    max_model_len = min(2048, max_len_cfg)
    return dict(max_num_seqs=16, max_num_batched_tokens=512, max_model_len=max_model_len, block_size=block_size,
                num_kv_blocks=16 * _round_up(max_model_len, block_size) // block_size, enable_prefix_caching=True)


def _samples_from(runs: Sequence[Sequence[tuple[list[Entry], float, float, float]]]) -> tuple[list[Sample], float]:
    """(entries, start, end, forward) per step, grouped by run -> samples with the median loop gap added."""
    gaps = [b[1] - a[2] for evs in runs for a, b in zip(evs, evs[1:])]
    gap = statistics.median(gaps) if gaps else 0.0
    return [(entries, end - start + gap, fwd) for evs in runs for entries, start, end, fwd in evs], gap


def run_calibration(model: str, dtype: str = "auto", *, block_size: int = 16, mode: str = "serve",
                    num_threads: int | None = None, seed: int = 0,
                    log: Callable[[str], None] | None = None) -> tuple[list[Sample], float, dict]:
    """Run the calibration plan on the real engine; ([(entries, period_s, forward_s)], median gap_s, info).

    mode "serve" (the default) measures the engine the way `bench serve` uses it: a real
    `tokenloom serve` process, fed the plan over HTTP by a streaming client in this
    process, so the steps pay for the server's event loop and the client sharing the
    machine; the server reports its steps through the engine's observer API.
    mode "offline" runs `LLM.generate` in this process (no HTTP, no client).
    """
    if mode not in CALIBRATION_MODES:
        raise ValueError(f"calibration mode must be one of {CALIBRATION_MODES}, got {mode!r}")
    log = log or (lambda s: None)
    if mode == "serve":
        return _run_calibration_served(model, dtype, block_size=block_size, num_threads=num_threads, seed=seed,
                                       log=log)
    from tokenloom.bench.offline import run_offline
    from tokenloom.bench.workloads import vocab_range_for
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.sampling_params import SamplingParams

    limits = _engine_limits(model, block_size)
    llm = LLM(model, dtype=dtype, num_threads=num_threads, seed=seed, **limits)
    events: list = []
    llm.add_observer(events.append)
    vocab = vocab_range_for(llm.get_tokenizer(), llm.llm_engine.vocab_size)
    plan = calibration_plan(vocab, limits["max_model_len"], seed)
    # Warm-up: the first forward passes pay one-time costs (allocator, lazy init).
    llm.generate([{"prompt_token_ids": list(range(vocab[0], vocab[0] + 16))}] * 2,
                 SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0), use_tqdm=False)
    runs: list[list] = []
    step_s = 0.0
    for name, items in plan:
        events.clear()
        t0 = time.perf_counter()
        run_offline(llm, _requests(items, step_s), ignore_eos=True)
        runs.append([_event_row(ev) for ev in events])
        step_s = step_s or _decode_step_s(runs[-1])
        log(f"  {name}: {len(events)} steps in {time.perf_counter() - t0:.1f} s")
    samples, gap = _samples_from(runs)
    info = {"mode": mode, "threads": _torch_threads(), "dtype": str(llm.llm_engine.loaded.dtype).replace("torch.", "")}
    del llm
    return samples, gap, info


def _decode_step_s(rows: Sequence[tuple[list[Entry], float, float, float]]) -> float:
    """Median period of the decode-only steps among `rows` (the plan's arrival unit)."""
    periods = [end - start for entries, start, end, _ in rows
               if entries and all(n == 1 and c > 0 for n, c, _ in entries)]
    return statistics.median(periods) if periods else 0.1


def _rows_between(steps_file: Path, t0: float, t1: float) -> list[tuple[list[Entry], float, float, float]]:
    """Steps the calibration server has logged so far that started in [t0, t1]."""
    rows = []
    for line in steps_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            r = json.loads(line)
            if t0 <= r["start"] <= t1:
                rows.append((r["entries"], r["start"], r["end"], r["forward"]))
    return rows


def _event_row(ev: Any) -> tuple[list[Entry], float, float, float]:
    entries = [(e.num_tokens, e.kv_len_before, e.sampled_token_id is not None) for e in ev.entries]
    return entries, ev.start_time, ev.end_time, ev.forward_time


def _run_calibration_served(model: str, dtype: str, *, block_size: int, num_threads: int | None, seed: int,
                            log: Callable[[str], None]) -> tuple[list[Sample], float, dict]:
    import subprocess
    import sys
    import tempfile

    from tokenloom.bench.launcher import ServerProcess, free_port
    from tokenloom.bench.serve import run_serve_benchmark
    from tokenloom.bench.workloads import BenchRequest, vocab_range_for_model

    limits = _engine_limits(model, block_size)
    flags = ["--dtype", dtype, "--max-num-seqs", str(limits["max_num_seqs"]),
             "--max-num-batched-tokens", str(limits["max_num_batched_tokens"]),
             "--max-model-len", str(limits["max_model_len"]), "--block-size", str(block_size),
             "--num-kv-blocks", str(limits["num_kv_blocks"]), "--enable-prefix-caching", "--seed", str(seed),
             "--disable-access-log", "--log-level", "warning"]
    if num_threads:
        flags += ["--num-threads", str(num_threads)]
    steps_file = Path(tempfile.mkstemp(prefix="tokenloom-calib-steps-", suffix=".jsonl")[1])
    log_file = Path(tempfile.mkstemp(prefix="tokenloom-calib-serve-", suffix=".log")[1])
    port = free_port()
    cmd = [sys.executable, "-m", "tokenloom.sim.calibrate", "--steps-out", str(steps_file), "--",
           "serve", model, "--host", "127.0.0.1", "--port", str(port), *flags]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    with open(log_file, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc=proc, host="127.0.0.1", port=port, log_path=log_file, cmd=cmd)
    marks: list[tuple[str, float, float]] = []
    try:
        server.wait_healthy(timeout=600)
        vocab = vocab_range_for_model(model)
        plan = calibration_plan(vocab, limits["max_model_len"], seed)
        warm = [BenchRequest(list(range(vocab[0], vocab[0] + 16)), 3)] * 2
        run_serve_benchmark(server.base_url, warm, num_warmups=1, progress=False)
        step_s = 0.0
        for name, items in plan:
            t0 = time.perf_counter()
            run_serve_benchmark(server.base_url, _requests(items, step_s), num_warmups=0, progress=False)
            marks.append((name, t0, time.perf_counter()))
            if not step_s:  # the first item is a decode batch: it sets the arrival unit
                step_s = _decode_step_s(_rows_between(steps_file, t0, marks[-1][2]))
    finally:
        server.stop()
    rows = [json.loads(line) for line in steps_file.read_text(encoding="utf-8").splitlines() if line.strip()]
    steps_file.unlink(missing_ok=True)
    if server.proc.returncode not in (0, None) and not rows:
        raise RuntimeError(f"the calibration server failed:\n{server.log_tail()}")
    log_file.unlink(missing_ok=True)
    # Group the server's steps by plan item (both clocks are perf_counter on one machine).
    runs = []
    for name, t0, t1 in marks:
        evs = [(r["entries"], r["start"], r["end"], r["forward"]) for r in rows if t0 <= r["start"] <= t1]
        runs.append(evs)
        log(f"  {name}: {len(evs)} steps in {t1 - t0:.1f} s (served)")
    samples, gap = _samples_from(runs)
    return samples, gap, {"mode": "serve", "dtype": dtype}


def _serve_with_step_log(argv: Sequence[str]) -> int:
    """`python -m tokenloom.sim.calibrate --steps-out FILE -- serve MODEL [flags]`: `tokenloom serve`
    whose engine also writes every StepEvent's shape and times to FILE (one JSON line each)."""
    import argparse

    from tokenloom.entrypoints.cmd_serve import register
    from tokenloom.entrypoints.openai.api_server import build_server

    if len(argv) < 3 or argv[0] != "--steps-out" or argv[2] != "--":
        raise SystemExit("usage: python -m tokenloom.sim.calibrate --steps-out FILE -- serve MODEL [flags]")
    steps_out, rest = argv[1], list(argv[3:])
    parser = argparse.ArgumentParser(prog="tokenloom")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(rest)
    if args.model_tag is not None:
        args.model = args.model_tag
    server, engine = build_server(args)
    with open(steps_out, "w", encoding="utf-8") as f:
        def record(ev: Any) -> None:  # on the engine thread, after the step: not inside its timing
            entries, start, end, fwd = _event_row(ev)
            f.write(json.dumps({"entries": entries, "start": start, "end": end, "forward": fwd}) + "\n")
            f.flush()  # the calibrating client reads the log while the server runs

        engine.engine.add_observer(record)
        server.run()
        f.flush()
    return 0


def load_config_dict(model: str) -> dict:
    from tokenloom.specs.model_spec import load_config

    return load_config(model)[0]


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _engine_decode_reads_blocks_in_place() -> bool:
    """Whether the engine, on this machine's default device, runs our paged decode attention."""
    from tokenloom.kernels import cpu as cpu_kernels
    from tokenloom.model.loader import resolve_device

    return resolve_device("auto").type == "cpu" and cpu_kernels.attention_enabled()


# ---------------------------------------------------------------- cache
def engine_fingerprint() -> str:
    """Hash of the engine's hot-path source: a changed engine needs a new calibration."""
    root = Path(__file__).resolve().parent.parent
    h = hashlib.sha1()
    for pkg in _HOT_PATH:
        for p in sorted([*(root / pkg).glob("*.py"), *(root / pkg).glob("*.cpp"), *(root / pkg).glob("*.h")]):
            h.update(f"{pkg}/{p.name}".encode())
            h.update(p.read_bytes())
    return h.hexdigest()[:12]


def model_fingerprint(spec: ModelSpec) -> str:
    d = spec.to_dict()
    d.pop("name", None)
    d.pop("torch_dtype", None)
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:12]


def calibration_key(spec: ModelSpec, dtype: str, block_size: int, mode: str = "serve") -> str:
    from tokenloom.specs import microbench

    return (f"{microbench.cache_key()}|model={model_fingerprint(spec)}|dtype={dtype}|block={block_size}"
            f"|mode={mode}|engine={engine_fingerprint()}|v{CALIBRATION_VERSION}")


def _cache_path() -> Path:
    from tokenloom.specs import microbench

    return microbench.cache_dir() / _CACHE_FILE


def _read_cache() -> dict:
    try:
        data = json.loads(_cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) else {}


def _write_cache(key: str, cal: Calibration) -> None:
    path = _cache_path()
    entries = _read_cache()
    entries[key] = cal.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps({"version": CALIBRATION_VERSION, "entries": entries}, indent=1), encoding="utf-8")
    os.replace(tmp, path)  # readers never see half a file


def resolve_dtype(spec: ModelSpec, dtype: str | None) -> str:
    return normalize_dtype(dtype) if dtype and dtype != "auto" else spec.default_dtype()


def calibrate(model: str, dtype: str | None = "auto", *, block_size: int = 16, mode: str = "serve",
              refresh: bool = False, log: Callable[[str], None] | None = None) -> Calibration:
    """The cached calibration for `model` (a directory with weights) on this machine; measures if needed.

    `mode`: "serve" to predict `tokenloom serve` / `bench serve`, "offline" for in-process
    `LLM` runs (`bench throughput`, `bench sweep --mode offline`); see `run_calibration`."""
    from tokenloom.specs.hardware import local_hardware

    log = log or (lambda s: None)
    spec = load_model_spec(model)
    dt = resolve_dtype(spec, dtype)
    key = calibration_key(spec, dt, block_size, mode)
    if not refresh:
        cached = _read_cache().get(key)
        if cached is not None:
            return Calibration.from_dict(cached)
    if not Path(model).is_dir():
        raise ValueError(f"calibrating needs the model's weights: {model!r} is not a model directory "
                         f"(make one with `tokenloom make-model --preset NAME --out DIR`)")
    hw = local_hardware()
    log(f"calibrating {spec.name} ({dt}) on this machine, {mode} mode: running the engine over a fixed plan "
        f"of step shapes...")
    t0 = time.perf_counter()
    samples, gap, _ = run_calibration(model, dt, block_size=block_size, mode=mode, log=log)
    dispatch = hw.op_overhead_s * spec.eager_ops_per_step  # measured per-op cost x ops per forward
    paged = _engine_decode_reads_blocks_in_place()
    cal = fit(samples, StepFeatures(spec, dt, block_size, paged), bandwidth_ref=hw.mem_bandwidth,
              flop_rate_ref=hw.flops_for(dt), dispatch_s=dispatch)
    cal = _replace(cal, paged_decode=paged, step_gap_s=gap, key=key, model=spec.name, dtype=dt, mode=mode,
                   measured_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
                   calibration_wall_s=time.perf_counter() - t0,
                   samples=[{"entries": [list(e) for e in entries], "period_s": t, "forward_s": f}
                            for entries, t, f in samples])
    _write_cache(key, cal)
    return cal


def calibrated_cost_model(model: str, dtype: str | None = "auto", *, block_size: int = 16, mode: str = "serve",
                          refresh: bool = False, log: Callable[[str], None] | None = None) -> EngineCostModel:
    """`EngineCostModel` for `model` on `--hardware local` (calibrating once, then cached)."""
    from tokenloom.specs.hardware import local_hardware

    cal = calibrate(model, dtype, block_size=block_size, mode=mode, refresh=refresh, log=log)
    spec = load_model_spec(model)
    return EngineCostModel(spec, local_hardware(), resolve_dtype(spec, dtype), cal)


if __name__ == "__main__":
    import sys

    sys.exit(_serve_with_step_log(sys.argv[1:]))
