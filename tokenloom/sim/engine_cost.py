"""The calibrated step-time model: this engine's steps, timed from fitted rates.

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

The rates (bw, F, r_half, F_attn, G, the overheads and `combine`) are fitted by `sim.fit`
to steps measured by `entrypoints.calibration_run` (on `sim.calibration_plan`'s plan); `Calibration` holds them.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable, Sequence

from tokenloom.sim.estimate import CostModel, StepCost
from tokenloom.sim.step_features import Entry, StepFeatures, StepParts
from tokenloom.specs.hardware import Hardware
from tokenloom.specs.model_spec import ModelSpec


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
            f"weight streaming {self.bandwidth / 1e9:.2f} GB/s ({self.mem_efficiency:.2f} x microbench read "
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


def combine(overlap: str, mem_t, comp_t):
    """Memory and compute time of one GEMM: overlapped (max) or not (sum); works on numpy arrays too."""
    if overlap == "sum":
        return mem_t + comp_t
    import numpy as np

    return np.maximum(mem_t, comp_t)


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
        forward = forward_time(cal, p)
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


def rows_factor(rows, half_rows: float):
    """(r + r_half) / r: how much slower than `flop_rate` a GEMM over r rows runs (arrays too)."""
    return (rows + half_rows) / max(rows, 1) if half_rows else 1.0


def forward_time(cal: Calibration, p: StepParts) -> float:
    bw, F, h = cal.bandwidth, cal.flop_rate, cal.gemm_half_rows
    t = float(combine(cal.overlap, p.layer_bytes / bw, p.layer_flops / F * rows_factor(p.num_tokens, h)))
    if p.num_sampled:
        t += float(combine(cal.overlap, p.head_bytes / bw, p.head_flops / F * rows_factor(p.num_sampled, h)))
    return (t + p.attn_flops / cal.attn_flop_rate + p.gather_bytes / cal.gather_rate + p.kv_write_bytes / bw
            + cal.dispatch_s)


def predict(cal: Calibration, features: StepFeatures, entries_list: Iterable[Sequence[Entry]]) -> list[float]:
    """Whole-step seconds (forward + engine overhead) for each step."""
    out = []
    for entries in entries_list:
        p = features.parts(entries)
        out.append(forward_time(cal, p) + cal.overhead_s + cal.per_seq_overhead_s * p.num_seqs)
    return out
