"""Microbenchmarks of our CPU kernels against what they replace (the README's kernel figures).

    python scripts/bench_kernels.py [--rows 1,8,16,32,64,256] [--repeats 3]

* GEMM: the 24 decoder layers' matrices of Qwen2.5-0.5B (qkv 1152x896, o 896x896, gate/up
  9728x896, down 896x4864; 1.43 GB in fp32, more than any cache) at each row count, through
  our kernel for this CPU (`cpu.linear_op`) from 2 MiB pages (as the engine stores them, see
  kernels/hugepages.py), the same from a copy in 4 KiB pages, and oneDNN's packed GEMM.
* Decode attention: 32 requests of Qwen2.5-0.5B's heads (2 KV heads x 7 query heads, head_dim
  64) over 128 / 512 / 2048 tokens of context in shuffled 16-token blocks, the AVX2 build
  against the AVX-512 build (where the CPU has it).
* Greedy argmax over a [32, 151936] float32 logits row block: ours against torch.argmax.

Each figure is the median of `--repeats` alternating rounds (this machine is shared and noisy:
compare the two columns of one run, not runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom.kernels import cpu
from tokenloom.model.packed_linear import _pack

LAYER_SHAPES = [(1152, 896), (896, 896), (9728, 896), (896, 4864)]  # (N, K) per layer
LAYERS = 24


def _time(fn, inner: int = 1) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


def _median_rounds(fns: dict, repeats: int, inner: int = 1) -> dict:
    times = {k: [] for k in fns}
    for _ in range(repeats):
        for k, fn in fns.items():
            times[k].append(_time(fn, inner))
    return {k: statistics.median(v) for k, v in times.items()}


def bench_gemm(rows: list[int], repeats: int) -> None:
    g = torch.Generator().manual_seed(0)
    weights = [torch.randn(n, k, generator=g) for _ in range(LAYERS) for n, k in LAYER_SHAPES]
    ours = [(cpu.pack(w), w.shape[0]) for w in weights]
    small_pages = [(p.clone(), n) for p, n in ours]  # torch's allocator: 4 KiB pages
    op = cpu.linear_op(ours[0][0])
    onednn = [(_pack(w), w.shape[1]) for w in weights]
    del weights
    nbytes = sum(p.numel() * 4 for p, _ in ours)
    print(f"GEMM, {LAYERS} layers of Qwen2.5-0.5B matrices ({nbytes / 1e9:.2f} GB fp32), {op}:")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k in LAYER_SHAPES}
        flops = sum(2 * m * n * p.shape[1] for p, n in ours)

        def run_ours():
            for p, n in ours:
                op(xs[p.shape[1]], p, n, None)

        def run_small_pages():
            for p, n in small_pages:
                op(xs[p.shape[1]], p, n, None)

        def run_onednn():
            for w, k in onednn:
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

        t = _median_rounds({"ours": run_ours, "4k": run_small_pages, "oneDNN": run_onednn}, repeats)
        unit = (lambda s: f"{nbytes / s / 1e9:6.1f} GB/s") if m == 1 else (lambda s: f"{flops / s / 1e9:6.0f} GF/s")
        print(f"  {m:4d} rows: ours {unit(t['ours'])} (4 KiB pages {unit(t['4k'])})   oneDNN {unit(t['oneDNN'])}")


def bench_attention(repeats: int) -> None:
    hk, grp, d, bs, n = 2, 7, 64, 16, 32
    wide = cpu.attention_op()
    print(f"decode attention, {n} requests x {hk} KV heads x {grp} query heads, head_dim {d}:")
    for ctx in (128, 512, 2048):
        per = ctx // bs
        g = torch.Generator().manual_seed(ctx)
        k_cache = torch.randn(n * per, bs, hk, d, generator=g)
        v_cache = torch.randn(n * per, bs, hk, d, generator=g)
        q = torch.randn(n, hk * grp, d, generator=g)
        tables = torch.randperm(n * per, generator=g).view(n, per)
        lens = torch.full((n,), ctx)
        args = (q, k_cache, v_cache, tables, lens, d**-0.5)
        fns = {"AVX2": lambda: torch.ops.tokenloom_cpu.paged_decode_attention(*args), "ours": lambda: wide(*args)}
        t = _median_rounds(fns, repeats, inner=5)
        print(f"  context {ctx:5d} ({2 * k_cache.numel() * 4 / 1e6:5.0f} MB of KV): AVX2 {t['AVX2'] * 1e3:6.2f} ms"
              f"   {wide} {t['ours'] * 1e3:6.2f} ms   x{t['AVX2'] / t['ours']:.2f}")


def bench_argmax(repeats: int) -> None:
    x = torch.randn(32, 151936, generator=torch.Generator().manual_seed(0))
    t = _median_rounds({"torch": lambda: x.argmax(dim=-1), "ours": lambda: torch.ops.tokenloom_cpu.argmax_rows(x)},
                       repeats, inner=50)
    print(f"greedy argmax over [32, 151936]: torch.argmax {t['torch'] * 1e3:.2f} ms   ours {t['ours'] * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    a = ap.parse_args()
    if not cpu.load():
        raise SystemExit("our CPU kernels do not build here (needs x86 with AVX2 + FMA and a C++ toolchain)")
    cpu.avx512_enabled()
    bench_gemm([int(r) for r in a.rows.split(",")], a.repeats)
    bench_attention(a.repeats)
    bench_argmax(a.repeats)


if __name__ == "__main__":
    main()
