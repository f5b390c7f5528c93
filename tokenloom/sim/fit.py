"""Fitting the calibrated step-time model (`sim.engine_cost`) to measured engine steps.

The two parts of a step are fitted separately, so nothing constant has to be split
between them by guesswork:

* `o`, `o_seq`: least squares on the engine's own time per step (duration - forward
  time + the median gap between steps) against N.
* bw, F, F_attn, G and `combine`: the forward times, by a log grid over bw and F
  around the microbenchmark figures (`tokenloom.specs.microbench`) with 1/F_attn and 1/G
  solved at each point (non-negative least squares), minimising the squared
  *relative* error (a short decode step matters as much as a long prefill); both
  `combine`s, best wins.  On a shared machine a few steps are slowed by other
  processes: the fit is repeated without the steps it missed by far (see `fit`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Sequence

from tokenloom.sim.engine_cost import Calibration, combine, forward_time, predict, rows_factor
from tokenloom.sim.step_features import Entry, StepFeatures

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
    cal = dataclasses.replace(ranked[0][0], overhead_s=float(o), per_seq_overhead_s=float(o_seq),
                   num_dropped=len(samples) - len(kept))
    y = np.array([t for _, t, _ in kept])
    errs = np.abs(np.array(predict(cal, features, [e for e, _, _ in kept])) - y) / y
    other = math.nan
    if len(ranked) > 1:
        oc = dataclasses.replace(ranked[1][0], overhead_s=float(o), per_seq_overhead_s=float(o_seq))
        other = float(np.median(np.abs(np.array(predict(oc, features, [e for e, _, _ in kept])) - y) / y))
    return dataclasses.replace(cal, num_steps=len(kept), median_abs_rel_error=float(np.median(errs)),
                    p90_abs_rel_error=float(np.percentile(errs, 90)), max_abs_rel_error=float(errs.max()),
                    other_overlap_error=other)


def _kept(samples: Sequence[Sample], features: StepFeatures, cal: Calibration) -> list[int]:
    """Indices of the steps whose forward time `cal` explains (see `fit`)."""
    import numpy as np

    yf = np.array([f for _, _, f in samples])
    pf = np.array([forward_time(cal, features.parts(e)) for e, _, _ in samples])
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
    lf = np.array([p.layer_flops * rows_factor(p.num_tokens, half_rows) for p in parts])
    hb = np.array([p.head_bytes for p in parts])
    hf = np.array([p.head_flops * rows_factor(p.num_sampled, half_rows) for p in parts])
    has_head = np.array([p.num_sampled > 0 for p in parts])
    kvw = np.array([p.kv_write_bytes for p in parts])
    # Linear, non-negative: 1/F_attn x attention FLOPs + 1/G x gathered KV bytes (columns scaled to ~1).
    M = np.stack([np.array([p.attn_flops for p in parts]), np.array([p.gather_bytes for p in parts])], axis=1)
    scale = np.maximum(M.max(axis=0), 1e-30)
    Mw = (M / scale) * w[:, None]

    def solve(bw: float, F: float) -> tuple[float, np.ndarray]:
        base = (combine(overlap, lb / bw, lf / F) + np.where(has_head, combine(overlap, hb / bw, hf / F), 0.0)
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
