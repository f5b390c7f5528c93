"""`tokenloom bench roofline`: how close the engine's decode step gets to this machine's limits.

The seed's first open question -- how long does one decode step take, and so how many
tokens/s -- has a back-of-envelope answer: a decode step must stream every weight once
plus each request's KV history (memory bound), and do ~2 FLOPs per weight per token plus
attention (compute bound); whichever takes longer is the floor.  Here that floor is
computed from this machine's *measured* bandwidth and matmul FLOP/s
(`tokenloom.specs.microbench`) and the model's arithmetic (`tokenloom.specs.model_spec`),
and set against decode steps the engine really runs, at several batch sizes and context
lengths, read off its step events:

    fraction of memory roof  = (bytes / bandwidth) / forward time
    fraction of compute roof = (FLOPs / matmul FLOP/s) / forward time
    step at the roof         = max(memory, compute roof time) / step duration
    engine overhead          = step duration - forward time   (scheduling, bookkeeping)

The bandwidth is the rate a parallel *read* of a buffer well beyond the last-level cache
reaches (`measure_bandwidth`), because a decode step only reads its weights; a copy's rate
(reads plus writes) is lower on CPUs and would put the memory roof below what the engine's
own GEMMs stream.

A shared machine's bandwidth and FLOP/s drift while the benchmark runs (on the VMs this
was developed on, copy bandwidth flipped between two states from one second to the next;
docs/performance.md, "Measured figures", has the readings), so both are measured again around every point and each point is set against the
mean of the measurements just before and just after it.  When those two disagree by more
than 10% the machine changed state during the point, and it is timed again (`--max-tries`).

At batch 1 a decode step is memory bound (all weights for one token); as the batch grows
the same weight read serves more tokens, which is why batching raises tokens/s.
"""

from __future__ import annotations

import argparse
import math
from typing import Any

import numpy as np
from rich.console import Console

from tokenloom.measure import report
from tokenloom.bench.offline import build_llm, engine_vocab_range, run_generate
from tokenloom.measure.workloads import BenchRequest, WorkloadSpec, generate_workload


def _ints(text: str) -> list[int]:
    return [int(x) for x in str(text).replace(" ", "").split(",") if x]


def decode_point(llm: Any, spec: Any, dtype: str, batch: int, context: int, steps: int,
                 vocab: tuple[int, int], seed: int = 0) -> dict[str, Any]:
    """Time full-batch decode steps of `batch` requests whose prompts are `context` tokens;
    `against_roofs` adds the roofline columns."""
    eng = llm.llm_engine
    budget = eng.config.max_num_batched_tokens
    # Requests are prefilled a budget's worth at a time, so the first ones start decoding
    # early; enough output tokens keeps them all running until the last has caught up.
    max_tokens = math.ceil(batch * context / budget) + steps + 2
    if context + max_tokens > eng.config.max_model_len:
        raise ValueError(f"context {context} + {max_tokens} output tokens exceeds max_model_len {eng.config.max_model_len}")
    wl = WorkloadSpec(name="random", num_prompts=batch, input_len=(context, context),
                      output_len=(max_tokens, max_tokens), vocab_range=vocab, seed=seed)
    run = run_generate(llm, generate_workload(wl), ignore_eos=True, keep_events=True)
    full = [ev for ev in run.steps.events
            if len(ev.entries) == batch and all(e.phase == "decode" for e in ev.entries)][:steps]
    if not full:
        raise RuntimeError(f"no full-batch decode step at batch {batch}; is --max-num-seqs >= {batch}?")
    weight_bytes = spec.streamed_weight_bytes(dtype)
    kv_tok = spec.kv_bytes_per_token(dtype)
    dur = np.array([ev.duration for ev in full])
    fwd = np.array([ev.forward_time for ev in full])
    kv_lens = np.array([sum(e.kv_len_after for e in ev.entries) for ev in full])
    step_bytes = weight_bytes + kv_lens.mean() * kv_tok
    step_flops = float(np.mean([sum(spec.flops_per_token(e.kv_len_after) for e in ev.entries) for ev in full]))
    # Means, not medians, so step = forward + overhead holds in the table.
    fwd_mean = float(np.mean(fwd))
    dur_mean = float(np.mean(dur))
    return {
        "batch": batch,
        "context": context,
        "steps": len(full),
        "step_ms": dur_mean * 1e3,
        "forward_ms": fwd_mean * 1e3,
        "overhead_ms": (dur_mean - fwd_mean) * 1e3,
        "tokens_per_s": batch / dur_mean,
        "mbytes_per_step": step_bytes / 1e6,
        "gflop_per_step": step_flops / 1e9,
        "achieved_gb_per_s": step_bytes / fwd_mean / 1e9,
        "achieved_gflop_per_s": step_flops / fwd_mean / 1e9,
    }


def against_roofs(point: dict[str, Any], bandwidth: float, flops: float) -> dict[str, Any]:
    """`point` with its memory and compute roofline times for this bandwidth (bytes/s) and
    matmul rate (FLOP/s), and the fractions of them it reaches."""
    t_mem = point["mbytes_per_step"] * 1e6 / bandwidth
    t_comp = point["gflop_per_step"] * 1e9 / flops
    fwd, dur = point["forward_ms"] / 1e3, point["step_ms"] / 1e3
    return {
        **point,
        "bandwidth_gb_per_s": bandwidth / 1e9,
        "matmul_gflop_per_s": flops / 1e9,
        "roof_mem_ms": t_mem * 1e3,
        "roof_compute_ms": t_comp * 1e3,
        "frac_mem_roof": t_mem / fwd,
        "frac_compute_roof": t_comp / fwd,
        "frac_step_at_roof": max(t_mem, t_comp) / dur,
        "roofline_tokens_per_s": point["batch"] / max(t_mem, t_comp),
        "bound": "memory" if t_mem >= t_comp else "compute",
    }


# Readings before and after a point further apart than this (relative) send it round again.
STEADY_SPREAD = 0.10


def _spread(before: tuple[float, float], after: tuple[float, float]) -> float:
    """How far apart two (bandwidth, FLOP/s) readings are: the larger relative difference."""
    return max(abs(x - y) / max(x, y) for x, y in zip(before, after))


def _display(r: dict[str, Any]) -> dict[str, Any]:
    """Short column names so the table fits a terminal."""
    return {
        "batch": r["batch"], "ctx": r["context"], "step": r["step_ms"], "fwd": r["forward_ms"],
        "ovh": r["overhead_ms"], "tok/s": r["tokens_per_s"], "mem roof": r["roof_mem_ms"],
        "cmp roof": r["roof_compute_ms"], "%mem": 100 * r["frac_mem_roof"],
        "%cmp": 100 * r["frac_compute_roof"], "%step": 100 * r["frac_step_at_roof"], "bound": r["bound"][:3],
        "GB/s": r["bandwidth_gb_per_s"], "GF/s": r["matmul_gflop_per_s"],
    }


def main(args: argparse.Namespace) -> int:
    from tokenloom.specs.microbench import measure_bandwidth, measure_matmul_flops
    from tokenloom.specs.model_spec import ModelSpec, normalize_dtype

    console = Console(width=max(Console().width, 132))  # fourteen columns; wrapped they are unreadable
    batches = _ints(args.batch_sizes)
    contexts = _ints(args.context_lens)
    llm = build_llm(args, max_num_seqs=max(args.max_num_seqs, max(batches)))
    eng = llm.llm_engine
    device = eng.config.device
    dtype = normalize_dtype(eng.config.dtype)
    spec = ModelSpec.from_config(eng.hf_config, name=str(eng.model_name))
    vocab = engine_vocab_range(llm)

    console.print(f"[bold]bench roofline[/bold] model={eng.model_name} dtype={dtype} device={device}: measuring the machine...")
    bw_kw = {"nbytes": args.bandwidth_mib * 2**20} if args.bandwidth_mib else {}

    def measure() -> tuple[float, float]:
        return measure_bandwidth(device=device, **bw_kw), measure_matmul_flops(dtype=dtype, device=device)

    measured = [measure()]
    model = {"streamed_weight_mb": spec.streamed_weight_bytes(dtype) / 1e6,
             "kv_kb_per_token": spec.kv_bytes_per_token(dtype) / 1e3,
             "gflop_per_token_at_ctx0": spec.flops_per_token(0) / 1e9, "total_params": spec.total_params}

    # Untimed warm-up decode so the first point does not pay first-forward costs.
    run_generate(llm, [BenchRequest(list(range(vocab[0], vocab[0] + 8)), 4)], ignore_eos=True)
    rows = []
    for c in contexts:
        for b in batches:
            tries = []
            try:
                # A point whose bracketing readings disagree was timed while the machine changed
                # state: time it again, up to --max-tries, and keep the steadiest try.
                while len(tries) < max(1, args.max_tries):
                    point = decode_point(llm, spec, dtype, b, c, args.decode_steps, vocab, seed=args.seed)
                    before, after = measured[-1], measure()
                    measured.append(after)
                    tries.append((_spread(before, after), point, before, after))
                    if tries[-1][0] <= STEADY_SPREAD:
                        break
            except (ValueError, RuntimeError) as e:
                console.print(f"[yellow]skipped batch={b} context={c}:[/yellow] {e}")
                continue
            spread, point, before, after = min(tries, key=lambda t: t[0])
            r = against_roofs(point, (before[0] + after[0]) / 2, (before[1] + after[1]) / 2)
            r.update(machine_spread=spread, tries=len(tries))
            rows.append(r)
            if spread > STEADY_SPREAD:
                console.print(f"[yellow]  batch {b} ctx {c}: the machine's readings around it still differ by "
                              f"{100 * spread:.0f}% after {len(tries)} tries; its fractions are uncertain[/yellow]")
            console.print(f"  batch {b:>3} ctx {c:>5}: step {r['step_ms']:.2f} ms "
                          f"(forward {r['forward_ms']:.2f}), roofline {max(r['roof_mem_ms'], r['roof_compute_ms']):.2f} ms")
    bws, fls = [m[0] for m in measured], [m[1] for m in measured]
    machine = {"bandwidth_gb_per_s": float(np.median(bws)) / 1e9, "matmul_gflop_per_s": float(np.median(fls)) / 1e9,
               "ridge_flop_per_byte": float(np.median(fls) / np.median(bws)),
               "bandwidth_gb_per_s_range": f"{min(bws) / 1e9:.1f}-{max(bws) / 1e9:.1f}",
               "matmul_gflop_per_s_range": f"{min(fls) / 1e9:.0f}-{max(fls) / 1e9:.0f}"}
    console.print(report.dict_table({**machine, **model}, "Machine (median of the measurements around the points) and model"))
    console.print(report.rows_table([_display(r) for r in rows], "Decode step: achieved vs roofline (times in ms)",
                                    digits=1))
    console.print("%mem / %cmp = memory / compute roofline time as a share of the measured forward time "
                  "(100 = at the roof); %step = the higher roof as a share of the whole step; ovh = step - fwd "
                  "(scheduling and bookkeeping); GB/s, GF/s = the machine as measured around that point; "
                  "bound = the higher roof")
    if args.output_json:
        doc = report.build_report("roofline", config=report.args_to_config(args),
                                  results={"machine_roofline": machine, "model": model, "points": rows,
                                           "model_spec": spec.to_dict(), "dtype": dtype})
        report.write_json(args.output_json, doc)
        console.print(f"wrote {args.output_json}")
    return 0 if rows else 1
