"""AMX GEMMs beside the AVX-512 ones, chosen per row count by a one-time measurement.

`cpu_gemm_amx.cpp` multiplies bf16, int8 and int4 weights with AMX bf16 tiles, reading the
same packed weights as the AVX-512 kernels (so there is one copy of each weight and either
kernel can take any call).  Which one wins depends on how many rows the call has: at one row
both are bound by the weights' stream, from a few rows on the AVX-512 kernels by their
arithmetic, which AMX does about sixteen times faster.  So for each kernel ("bf16", "int8",
"int4") and row bucket (1, 2, 4, 8, 9, 16, ... 64 and more rows) both are timed once on a model-sized
matrix, and the faster one is used for calls of that bucket (`dispatch`).  The choice is
cached beside the kernel builds (kernels/build.py `cache_root`), keyed by CPU model, kernel
sources and this module's own; timed on one thread, in CPU time (robust on a busy machine).

Only where the AMX probe (kernels/amx_probe.py, a child process) said yes.  `TOKENLOOM_AMX=0`
keeps the AVX-512 kernels, `=1` takes AMX (the bf16-tile kernels) at every row count (tests),
`auto` (default) measures.  int8 weights have two AMX kernels: `linear_int8` widens them to
bf16 tiles (exact products), `linear_int8_limbs` (cpu_gemm_amx_limbs.cpp) multiplies them as
bytes in int8 tiles against each activation row written in fixed point as byte limbs (four, 2^-31
of the row's largest value; two, 2^-15, for a bf16 row without an outlier channel; nothing
widened), and the calibration picks between them per bucket.
`linear_int8_tiles` (two int8 planes per row, 2^-15.9 of the row's largest, which an outlier
channel ruins for the rest of the row) is kept for comparison and never chosen
(docs/quantization.md, "AMX").

The same extension holds the decode attention for bf16 KV caches (`cpu_attention_amx.cpp`:
q.k and p.v as tile products), which `decode_attention_op` takes wherever the probe said
yes; `TOKENLOOM_AMX=0` keeps the AVX-512 attention too.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import json
import logging
import os
import time
from pathlib import Path

import torch

from tokenloom.kernels import amx_probe, cpu
from tokenloom.kernels.build import _build, cache_root

# A call of M rows falls in the largest bucket <= M, timed at that many rows.  9 has a bucket of
# its own: from 9 rows our quantized kernels' float32 rows leave the VNNI integer path for the
# dequantized-block one (bf16 rows, which the calibration times, stay on it at every count).
BUCKETS = (1, 2, 4, 8, 9, 16, 32, 64)
KINDS = ("bf16", "int8", "int4")
# Quantized calls of fewer rows stay on the VNNI build's integer path (cpu_gemm_quant.cpp
# `kIntegerRows`), whatever the timing: it keeps each activation to 2^-20 of its block of 32
# (2^-13 for bf16 ones; an outlier 10^4 times larger costs the others nothing),
# and a row's result is then the same in a call of 1 row as of up to 8, which speculative
# verifying steps rely on (docs/quantization.md, "Integer dot products").
MIN_QUANT_ROWS = 9
# float32 activations of quantized weights keep our kernels below this many rows: on AMX they are
# two bf16 planes (twice the tile work the calibration's bf16 rows timed) and kept to 2^-17 of
# each value, where our dequantized-block path multiplies them in float32.
MIN_QUANT_ROWS_FLOAT32 = 16
CALIBRATION_SHAPE = (896, 4864)  # (K, N) of the matrices timed: Qwen2.5-0.5B's MLP
_AMX_FLAGS = ["-mavx2", "-mfma", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
              "-mavx512vnni", "-mavx512vbmi", "-mamx-tile", "-mamx-int8", "-mamx-bf16"]


@functools.cache
def build() -> bool:
    """Compile and load the AMX extension (no tile instruction runs here)."""
    if not _build("tokenloom_cpu_amx", ["cpu_gemm_amx.cpp", "cpu_gemm_amx_limbs.cpp", "cpu_attention_amx.cpp"],
                  _AMX_FLAGS):
        return False
    torch.library.register_fake("tokenloom_amx::paged_decode_attention")(
        lambda q, k_cache, v_cache, block_tables, context_lens, scale: torch.empty_like(q))
    for name in ("linear_bf16",):
        torch.library.register_fake(f"tokenloom_amx::{name}")(
            lambda x, weight_packed, n, bias: x.new_empty((*x.shape[:-1], n)))
    for name in ("linear_int8", "linear_int8_limbs"):
        torch.library.register_fake(f"tokenloom_amx::{name}")(
            lambda x, qweight, scales, n, bias: x.new_empty((*x.shape[:-1], n)))
    for name in ("linear_int4",):
        torch.library.register_fake(f"tokenloom_amx::{name}")(
            lambda x, qweight, scales, n, group, bias: x.new_empty((*x.shape[:-1], n)))
    return True


def enabled() -> bool:
    """Whether the AMX kernels run in this process: usable tiles (the probe) and a build."""
    return amx_probe.amx_usable() and build()


def bucket(rows: int) -> int:
    """Index into BUCKETS of a call with `rows` rows."""
    return max(bisect.bisect_right(BUCKETS, rows) - 1, 0)


def _calibration_path() -> Path:
    h = hashlib.sha256()
    for part in (amx_probe.cpu_model(), *KINDS, *map(str, BUCKETS)):
        h.update(part.encode() + b"\0")
    here = Path(__file__).parent
    for f in ("amx.py", "cpu_gemm_amx.cpp", "cpu_gemm_amx_limbs.cpp", "amx_tiles.h", "cpu_gemm_quant.cpp",
              "quant_vnni.h", "cpu_gemm_bf16.cpp"):
        h.update((here / f).read_bytes())
    return cache_root() / f"amx_calibration_{h.hexdigest()[:16]}.json"


def _best_of(fns, x: torch.Tensor, reps: int, seconds: float) -> list[float]:
    """The fastest of at least `reps` calls (more, up to `seconds`) of each of `fns` on x, taken
    in turns, in this thread's CPU time: run on one thread (`calibrate`), a call's CPU time
    leaves out the time other processes had the core, which wall time on a busy machine does
    not (there a two-thread call waits for whichever of its threads was descheduled)."""
    best = [float("inf")] * len(fns)
    for f in fns:
        f(x)
    end = time.perf_counter() + seconds
    done = 0
    while done < reps or (time.perf_counter() < end and done < 50 * reps):
        done += 1
        for i, f in enumerate(fns):
            t0 = time.thread_time()
            f(x)
            best[i] = min(best[i], time.thread_time() - t0)
    return best


def _candidates(kind: str):
    """Our AVX-512 op and the AMX ops for `kind`, as functions of x, on one random
    calibration-sized matrix: [(name, fn)], ours first."""
    k, n = CALIBRATION_SHAPE
    g = torch.Generator().manual_seed(0)
    amx = torch.ops.tokenloom_amx
    if kind == "bf16":
        assert cpu.bf16_enabled(), "the AVX512-BF16 kernel did not build"
        w = cpu.pack_pairs(torch.randn(n, k, generator=g).to(torch.bfloat16))
        base = cpu.linear_op(w)
        return [("ours", lambda x: base(x, w, n, None)), ("linear_bf16", lambda x: amx.linear_bf16(x, w, n, None))]
    ops = cpu.quant_ops()
    q = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    if kind == "int8":
        w, s = cpu.pack_int8(q, torch.rand(n, generator=g) / 100, quads=True)
        return [("ours", lambda x: ops.linear_int8(x, w, s, n, None)),
                ("linear_int8", lambda x: amx.linear_int8(x, w, s, n, None)),
                ("linear_int8_limbs", lambda x: amx.linear_int8_limbs(x, w, s, n, None))]
    w, s = cpu.pack_int4(q.clamp(-8, 7), (torch.rand(n, k // 32, generator=g) / 100).to(torch.bfloat16))
    return [("ours", lambda x: ops.linear_int4(x, w, s, n, 32, None)),
            ("linear_int4", lambda x: amx.linear_int4(x, w, s, n, 32, None))]


def calibrate(reps: int = 10, seconds: float = 0.4) -> dict:
    """Time our kernel and each AMX kernel of every kind at every bucket: {kind: {"names": [op
    names, ours first], "pick": [index per bucket], "ms": [[ms per name] per bucket]}}.  AMX is
    taken from the smallest bucket from which an AMX kernel beat ours at every larger bucket
    too (one noisy win among losses does not switch a bucket), the fastest AMX kernel there."""
    out: dict = {}
    assert build(), "the AMX kernel did not build"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # both kernels split panels evenly over threads: one core's rates decide
    try:
        for kind in KINDS:
            out[kind] = _calibrate_kind(kind, reps, seconds)
    finally:
        torch.set_num_threads(threads)
    return out


def _calibrate_kind(kind: str, reps: int, seconds: float) -> dict:
    """One kind's timings and picks (see `calibrate`); activations in bf16, as models pass them."""
    cands = _candidates(kind)
    ms = []
    for rows in BUCKETS:
        x = torch.randn(rows, CALIBRATION_SHAPE[0]).to(torch.bfloat16)
        ms.append([t * 1e3 for t in _best_of([f for _, f in cands], x, reps, seconds)])
    wins = [min(t[1:]) < t[0] for t in ms]
    if kind in ("int8", "int4"):  # the VNNI build's integer path keeps its decode rows (see the module doc)
        wins = [w and rows >= MIN_QUANT_ROWS for w, rows in zip(wins, BUCKETS)]
    pick = [1 + min(range(len(t) - 1), key=lambda i: t[1 + i]) if all(wins[b:]) else 0 for b, t in enumerate(ms)]
    return {"names": [name for name, _ in cands], "pick": pick, "ms": ms}


@functools.cache
def choices() -> dict:
    """The calibration of this machine, measured once and cached (see the module doc)."""
    path = _calibration_path()
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        pass
    res = calibrate()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res))
    return res


def dispatch(kind: str, ours):
    """The function to multiply with for `kind` (same arguments as `ours`): `ours` where AMX is
    off or never wins, else one AMX op for every call or one that picks by the call's rows."""
    mode = os.environ.get("TOKENLOOM_AMX", "auto")
    if mode == "0" or not enabled():
        return ours
    if mode == "1":
        return getattr(torch.ops.tokenloom_amx, f"linear_{kind}")
    try:
        c = choices()[kind]
    except Exception as e:  # a calibration that cannot run leaves the AVX-512 kernels in charge
        logging.getLogger("tokenloom.kernels.cpu").warning("AMX calibration failed (%s); not using AMX", e)
        return ours
    ops = [ours, *(getattr(torch.ops.tokenloom_amx, name) for name in c["names"][1:])]
    per_bucket = [ops[i] for i in c["pick"]]
    per_bucket_f32 = per_bucket
    if kind in ("int8", "int4"):
        per_bucket_f32 = [ours if rows < MIN_QUANT_ROWS_FLOAT32 else op for rows, op in zip(BUCKETS, per_bucket)]
    if all(op is per_bucket[0] for op in per_bucket + per_bucket_f32):
        return per_bucket[0]

    def pick(x, *args):
        table = per_bucket_f32 if x.dtype == torch.float32 else per_bucket
        return table[bucket(x.numel() // max(x.shape[-1], 1))](x, *args)

    return pick


def with_amx(kind: str, ours):
    """`ours` (a linear op of the bf16 / int8 / int4 kernel) or, on machines with usable AMX,
    a function taking the same arguments that runs the AMX kernel of `kind` for the row
    counts where it measured faster (`dispatch`)."""
    if kind in ("int8", "int4") and not cpu.int8_quads():
        # Calibrated against the VNNI build (and the AMX int8 kernels read the k-quad panels
        # only it packs): a forced other build (TOKENLOOM_CPU_QUANT) runs alone.
        return ours
    if not enabled():
        return ours
    return dispatch(kind, ours)


def linear_op(packed: torch.Tensor):
    """kernels/cpu.py `linear_op`, with the AMX bf16 kernel for the rows it wins on k-pair panels."""
    ours = cpu.linear_op(packed)
    return with_amx("bf16", ours) if packed.dim() == 4 else ours


def _tile_attention(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether attention over bf16 caches of this head size runs on tiles here (AMX usable, head
    sizes that are multiples of 32); `TOKENLOOM_CPU_ATTENTION=avx512` / `=avx2` or
    `TOKENLOOM_AMX=0` keep the vector builds and SDPA."""
    return (device.type == "cpu" and dtype == torch.bfloat16 and head_dim % 32 == 0
            and os.environ.get("TOKENLOOM_CPU_ATTENTION") not in ("avx2", "avx512")
            and os.environ.get("TOKENLOOM_AMX") != "0" and enabled())


def prefill_attention_op(device: torch.device, dtype: torch.dtype, head_dim: int):
    """The tile kernel for causal prefills from each request's first token where attention runs
    on tiles (`_tile_attention`), else None (SDPA)."""
    return torch.ops.tokenloom_amx.causal_prefill_attention if _tile_attention(device, dtype, head_dim) else None


def decode_attention_op(device: torch.device, dtype: torch.dtype, head_dim: int):
    """kernels/cpu.py `decode_attention_op`, with the tile build (`cpu_attention_amx.cpp`) where
    attention runs on tiles (`_tile_attention`)."""
    ours = cpu.decode_attention_op(device, dtype, head_dim)
    return torch.ops.tokenloom_amx.paged_decode_attention if ours is not None and _tile_attention(
        device, dtype, head_dim) else ours
