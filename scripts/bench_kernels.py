"""Microbenchmarks of our CPU kernels against what they replace (the README's kernel figures).

    python scripts/bench_kernels.py [--rows 1,8,16,32,64,256] [--repeats 3] [--sections gemm,attention,...]

* GEMM: the 24 decoder layers' matrices of Qwen2.5-0.5B (qkv 1152x896, o 896x896, gate/up
  9728x896, down 896x4864; 1.43 GB in fp32, more than any cache) at each row count, through
  our kernel for this CPU (`cpu.linear_op`) from 2 MiB pages (as the engine stores them, see
  kernels/hugepages.py), the same from a copy in 4 KiB pages, and oneDNN's packed GEMM; at one
  row also per matrix shape, beside the memory roof's read rate and a copy rate.  Then the
  bf16 kernel over the same matrices (on CPUs with AVX512-BF16) at 1 and 32 rows.
* Decode attention: 32 requests of Qwen2.5-0.5B's heads (2 KV heads x 7 query heads, head_dim
  64) over 128 / 512 / 2048 tokens of context in shuffled 16-token blocks, the AVX2 build
  against the AVX-512 build (where the CPU has it); then bf16 caches, the AVX-512 build against
  the AMX tile build (where AMX runs), from cache and each of 24 layers' caches once.
* Greedy argmax over a [32, 151936] float32 logits row block: ours against torch.argmax.
* The sampler (runner/sampler.py) over 32 such rows, peaked and flat: greedy, temperature,
  top-p, top-k.

Each figure is the median of `--repeats` alternating rounds (this machine is shared and noisy:
compare the two columns of one run, not runs).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tokenloom.kernels import cpu
from tokenloom.kernels import glibc_heap
from tokenloom.specs.microbench import measure_bandwidth, measure_copy_bandwidth
from tokenloom.model.weights.packed_linear import _pack

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
    ours = [(cpu.pack_for(w), w.shape[0]) for w in weights]  # the engine's layout on this CPU
    small_pages = [(p.clone(), n) for p, n in ours]  # torch's allocator: 4 KiB pages
    op = cpu.linear_op(ours[0][0])
    onednn = [(_pack(w), w.shape[1]) for w in weights]
    del weights
    nbytes = sum(p.numel() * 4 for p, _ in ours)
    print(f"GEMM, {LAYERS} layers of Qwen2.5-0.5B matrices ({nbytes / 1e9:.2f} GB fp32), {op}:")
    for m in rows:
        xs = {k: torch.randn(m, k, generator=g) for _, k in LAYER_SHAPES}
        flops = sum(2 * m * n * p.shape[1] for p, n in ours)

        def run(panels):
            for p, n in panels:
                op(xs[p.shape[1]], p, n, None)

        def run_onednn():
            for w, k in onednn:
                torch.ops.mkldnn._linear_pointwise(xs[k], w, None, "none", [], "")

        t = _median_rounds({"ours": lambda: run(ours), "4k": lambda: run(small_pages), "oneDNN": run_onednn}, repeats)
        unit = (lambda s: f"{nbytes / s / 1e9:6.1f} GB/s") if m == 1 else (lambda s: f"{flops / s / 1e9:6.0f} GF/s")
        print(f"  {m:4d} rows: ours {unit(t['ours'])} (4 KiB pages {unit(t['4k'])})   oneDNN {unit(t['oneDNN'])}")
        if m == 1:  # which matrices stream at the read rate, next to read and copy readings of the same moment
            shapes = {}
            for p, n in ours:
                shapes.setdefault((n, p.shape[1]), []).append(p)
            fns = {s: (lambda s=s, ps=ps: [op(xs[s[1]], p, s[0], None) for p in ps]) for s, ps in shapes.items()}
            ts = _median_rounds(fns, repeats)
            per = "   ".join(f"{n}x{k} {sum(p.numel() * 4 for p in shapes[(n, k)]) / ts[(n, k)] / 1e9:5.1f} GB/s"
                             f" ({ts[(n, k)] / len(shapes[(n, k)]) * 1e6:.0f} us/call)" for n, k in shapes)
            flat = torch.ones(nbytes // 4)  # the same bytes read by PyTorch's vectorized sum, nothing written
            t_read = _median_rounds({"sum": flat.sum}, repeats)["sum"]
            del flat
            print(f"        by matrix (x{LAYERS}): {per}; read (stream_read) {measure_bandwidth() / 1e9:.1f} GB/s, "
                  f"copy {measure_copy_bandwidth() / 1e9:.1f} GB/s, "
                  f"plain read (torch.sum) {nbytes / t_read / 1e9:.1f} GB/s")
    del ours, small_pages, onednn
    if cpu.bf16_enabled():  # the bf16 kernel over the same matrices, half the bytes
        pairs = [(cpu.pack_pairs(torch.randn(n, k, generator=g).bfloat16()), n, k)
                 for _ in range(LAYERS) for n, k in LAYER_SHAPES]
        op16 = cpu.linear_op(pairs[0][0])
        nbytes16 = sum(p.numel() * 2 for p, _, _ in pairs)
        for m in (1, 32):
            xs = {k: torch.randn(m, k, generator=g).bfloat16() for _, k in LAYER_SHAPES}
            t16 = _median_rounds({"bf16": lambda: [op16(xs[k], p, n, None) for p, n, k in pairs]}, repeats)["bf16"]
            rate = f"{nbytes16 / t16 / 1e9:.1f} GB/s" if m == 1 else \
                f"{sum(2 * m * n * k for _, n, k in pairs) / t16 / 1e9:.0f} GF/s"
            print(f"  bf16, {op16}, {m} rows: {rate} ({nbytes16 / 1e9:.2f} GB)")


def bench_attention(repeats: int, bs: int = 16) -> None:
    hk, grp, d, n = 2, 7, 64, 32
    wide = cpu.attention_op()
    print(f"decode attention, {n} requests x {hk} KV heads x {grp} query heads, head_dim {d}, {bs}-token blocks:")
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
        # As in a decode step: each layer's cache once, so every block comes from DRAM (the
        # weights streamed in between have evicted it), not from the cache the loop above reuses.
        layers = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache))
                                         for _ in range(LAYERS - 1)]
        dram = _median_rounds({"ours": lambda: [wide(q, k, v, *args[3:]) for k, v in layers]}, repeats)["ours"]
        dram /= LAYERS
        nbytes = 2 * k_cache.numel() * 4
        print(f"  context {ctx:5d} ({nbytes / 1e6:5.0f} MB of KV): AVX2 {t['AVX2'] * 1e3:6.2f} ms"
              f"   {wide} {t['ours'] * 1e3:6.2f} ms   x{t['AVX2'] / t['ours']:.2f}"
              f"   ours from DRAM (each of {LAYERS} layers' caches once) {dram * 1e3:6.2f} ms, {nbytes / dram / 1e9:5.1f} GB/s")
        del layers


def bench_attention_bf16(repeats: int, bs: int = 16) -> None:
    """bf16 caches, as a bf16 model keeps them: the AVX-512 loop against the AMX tile build
    (kernels/cpu_attention_amx.cpp) where the CPU runs it, from cache and, as in a step, each
    of 24 layers' caches once (from DRAM)."""
    from tokenloom.kernels import amx

    hk, grp, d = 2, 7, 64
    ops = {"AVX-512": cpu.attention_op()}
    if amx.enabled():
        ops["AMX"] = torch.ops.tokenloom_amx.paged_decode_attention
    print(f"decode attention, bf16 caches, {hk} KV heads x {grp} query heads, head_dim {d}, {bs}-token blocks:")
    for n, ctx in ((1, 128), (16, 128), (16, 512), (32, 300), (32, 2048)):
        per = -(-ctx // bs)
        g = torch.Generator().manual_seed(ctx + n)
        layers = [(torch.randn(n * per, bs, hk, d, generator=g).bfloat16(),
                   torch.randn(n * per, bs, hk, d, generator=g).bfloat16()) for _ in range(LAYERS)]
        q = torch.randn(n, hk * grp, d, generator=g).bfloat16()
        tables = torch.randperm(n * per, generator=g).view(n, per)
        lens = torch.full((n,), ctx)
        k0, v0 = layers[0]
        hot = _median_rounds({name: (lambda op=op: op(q, k0, v0, tables, lens, d**-0.5)) for name, op in ops.items()},
                             repeats, inner=5)
        cold = _median_rounds({name: (lambda op=op: [op(q, k, v, tables, lens, d**-0.5) for k, v in layers])
                               for name, op in ops.items()}, repeats)
        line = "   ".join(f"{name} {hot[name] * 1e6:7.1f} us (DRAM {cold[name] / LAYERS * 1e6:7.1f})" for name in ops)
        ratio = (f"   AMX x{hot['AVX-512'] / hot['AMX']:.2f} (DRAM x{cold['AVX-512'] / cold['AMX']:.2f})"
                 if "AMX" in ops else "")
        print(f"  {n:2d} requests x {ctx:5d} tokens: {line}{ratio}")
        del layers


def bench_sampler(repeats: int) -> None:
    """The sampler over 32 rows of Qwen2.5-sized logits: peaked (a trained model's) and flat (a
    random-weight model's), greedy, temperature only, top-p and top-k."""
    from tokenloom import SamplingParams
    from tokenloom.runner.sampler import SamplingRow, sample

    g = torch.Generator().manual_seed(0)
    row = torch.empty(151936)
    t = _median_rounds({"exp": lambda: row.exponential_(generator=g)}, repeats, inner=5)["exp"]
    print(f"sampler, 32 x 151936 logits (one row's 151,936 exponentials, the old draw's cost per row: {t * 1e3:.2f} ms):")
    for spread, name in ((5.0, "peaked"), (1.0, "flat")):
        logits = torch.randn(32, 151936, generator=g) * spread
        cases = {"greedy": {"temperature": 0.0}, "temperature 1": {}, "top_p 0.95": {"top_p": 0.95},
                 "top_k 50": {"top_k": 50}}
        fns = {}
        for label, kw in cases.items():
            rows = [SamplingRow("r", SamplingParams(**{"temperature": 1.0, **kw}), [], [], frozenset(), None)
                    for _ in range(32)]
            fns[label] = lambda rows=rows: sample(logits, rows)
        ts = _median_rounds(fns, repeats)
        print(f"  {name:6s}: " + "   ".join(f"{k} {v * 1e3:.1f} ms" for k, v in ts.items()))


def bench_argmax(repeats: int) -> None:
    x = torch.randn(32, 151936, generator=torch.Generator().manual_seed(0))
    t = _median_rounds({"torch": lambda: x.argmax(dim=-1), "ours": lambda: torch.ops.tokenloom_cpu.argmax_rows(x)},
                       repeats, inner=50)
    print(f"greedy argmax over [32, 151936]: torch.argmax {t['torch'] * 1e3:.2f} ms   ours {t['ours'] * 1e3:.2f} ms")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,8,16,32,64,256")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16, help="KV block size for the attention timings (default: 16)")
    ap.add_argument("--sections", default="gemm,attention,attention-bf16,argmax,sampler",
                    help="which of gemm, attention, attention-bf16, argmax, sampler to run")
    a = ap.parse_args()
    sections = set(a.sections.split(","))
    glibc_heap.keep_step_buffers()  # as the engine runs
    if not cpu.load():
        raise SystemExit("our CPU kernels do not build here (needs x86 with AVX2 + FMA and a C++ toolchain)")
    cpu.avx512_enabled()
    if "gemm" in sections:
        bench_gemm([int(r) for r in a.rows.split(",")], a.repeats)
    if "attention" in sections:
        bench_attention(a.repeats, a.block_size)
    if "attention-bf16" in sections:
        bench_attention_bf16(a.repeats, a.block_size)
    if "argmax" in sections:
        bench_argmax(a.repeats)
    if "sampler" in sections:
        bench_sampler(a.repeats)


if __name__ == "__main__":
    main()
