"""`tokenloom estimate` (and `tokenloom simulate`): the seed's step-time arithmetic on the CLI.

    tokenloom estimate --hardware rtx4090 --model qwen2.5-0.5b --batch-size 1,8,32 --context-len 1024

prints, for each batch size, the bytes and FLOPs of one decode step, which bound wins,
the step time and tokens/s -- then the same formula with the numbers plugged in for the
smallest batch, so a reader can redo it by hand, the crossover batch size and the
prefill (TTFT) floor.  `--hardware local` measures this machine first (cached).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tokenloom.config import EngineArgs
from tokenloom.sim.band import band_figures, band_runs, band_table
from tokenloom.sim.estimate_report import catalog_table, model_line, decode_table, explain, fmt_time
from tokenloom.specs.hardware import LOCAL, Hardware, hardware_names

DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64,128,256"


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        sizes = [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-size wants comma-separated integers, got {text!r}") from None
    if not sizes or any(b < 1 for b in sizes):
        raise argparse.ArgumentTypeError("--batch-size values must be >= 1")
    return sizes


# ---------------------------------------------------------------- registration
def _add_cost_args(p: argparse.ArgumentParser) -> None:
    """Flags that pick the cost model: shared by `estimate` and `simulate`."""
    from tokenloom.specs.weight_formats import KV_FORMATS, weight_format_names

    g = p.add_argument_group("cost model")
    g.add_argument("--hardware", default="rtx4090", metavar="NAME",
                   help=f"one of: {', '.join(hardware_names())}, or a GPU of --hardware-file (default: rtx4090)")
    g.add_argument("--hardware-file", default=None, metavar="FILE",
                   help="TOML or JSON file describing GPUs (specs/hardware_file.py); --hardware names one of them")
    g.add_argument("--bandwidth", type=float, default=None, metavar="B/S",
                   help="memory bandwidth in bytes/s, replacing the hardware's (e.g. 1.7e12)")
    g.add_argument("--peak-flops", type=float, default=None, metavar="FLOP/S",
                   help="dense 16-bit tensor peak in FLOP/s, replacing the hardware's (fp32/fp8/int8 scale with it)")
    g.add_argument("--memory", default=None, metavar="SIZE", help="device memory, e.g. 80GiB, replacing the hardware's")
    g.add_argument("--model", default="qwen2.5-0.5b", metavar="PRESET|DIR",
                   help="model preset, reference model (llama-2-7b, llama-3.1-70b, ...) or a directory with "
                        "config.json (default: qwen2.5-0.5b)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                   help="activation/unquantized-weight dtype (default: the checkpoint's)")
    g.add_argument("--quantization", default=None, choices=["int8", "int4", "int4-g128"],
                   help="weight-only quantized matmul weights (the engine's --quantization): fewer bytes per step")
    g.add_argument("--weight-format", default=None, choices=weight_format_names(), metavar="FORMAT",
                   help="how the checkpoint stores its weights: GGUF (gguf-q8_0, gguf-q4_k_m, ...), gptq-int4, awq, "
                        "ct-w4a16, fp8 (W8A8, FP8 tensor rate), ... (default: every weight in --dtype); "
                        f"one of {', '.join(weight_format_names())}")
    g.add_argument("--kv-cache-dtype", default="auto", choices=["auto", *sorted(KV_FORMATS)],
                   help="KV cache storage (default: --dtype)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, metavar="N",
                   help="GPUs the model is split over (per-GPU bytes and FLOPs, two all-reduces per layer)")
    g.add_argument("--mem-efficiency", type=float, default=None,
                   help="plain roofline: fraction of peak bandwidth for every byte (default: kernel-by-kernel "
                        "efficiencies fitted to published figures; 1.0 on measured hardware)")
    g.add_argument("--compute-efficiency", type=float, default=None,
                   help="plain roofline: fraction of peak FLOP/s for every FLOP (see --mem-efficiency)")
    g.add_argument("--overhead-ms", type=float, default=None,
                   help="host time per step in ms (default: 0.3 on datasheet GPUs; measured op dispatch x ops per "
                        "step on local)")
    g.add_argument("--per-seq-overhead-ms", type=float, default=None,
                   help="host time per scheduled sequence and step in ms (default: 0.01 on datasheet GPUs)")
    g.add_argument("--refresh-local", action="store_true", help="re-run the local microbenchmarks")


def _cost_model_kwargs(args: argparse.Namespace) -> dict:
    """CostModel keyword arguments from the shared cost-model flags; without --weight-format or
    --quantization, the format a model directory's config.json declares (GPTQ, AWQ, compressed-tensors)."""
    weight_format = args.weight_format
    if weight_format is None and args.quantization is None:
        from tokenloom.specs.model_spec import load_config
        from tokenloom.specs.weight_formats import weight_format_from_config

        weight_format = weight_format_from_config(load_config(args.model)[0])
    return dict(
        mem_efficiency=args.mem_efficiency, compute_efficiency=args.compute_efficiency,
        overhead_s=None if args.overhead_ms is None else args.overhead_ms / 1e3,
        per_seq_overhead_s=None if args.per_seq_overhead_ms is None else args.per_seq_overhead_ms / 1e3,
        quantization=args.quantization, weight_format=weight_format,
        kv_cache_dtype=None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
    )


def _resolve_hardware(args: argparse.Namespace) -> Hardware:
    from tokenloom.specs.hardware_file import resolve_hardware

    return resolve_hardware(args.hardware, hardware_file=args.hardware_file, bandwidth=args.bandwidth,
                            peak_flops=args.peak_flops, memory=args.memory, refresh_local=args.refresh_local)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "estimate",
        help="roofline estimate of decode step time and tokens/s on a given GPU",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cost_args(p)
    p.add_argument("--batch-size", type=_parse_batch_sizes, default=_parse_batch_sizes(DEFAULT_BATCH_SIZES),
                   metavar="B1,B2,...", help=f"decode batch sizes (default: {DEFAULT_BATCH_SIZES})")
    p.add_argument("--context-len", type=int, default=1024, metavar="L",
                   help="tokens already in each request's KV cache (default: 1024)")
    p.add_argument("--prompt-len", type=int, default=512, metavar="P",
                   help="prompt length for the prefill / TTFT floor (default: 512; 0 to skip)")
    p.add_argument("--prefill-chunk", type=int, default=None, metavar="N",
                   help="prefill in chunks of N tokens (like --max-num-batched-tokens); default: one step")
    p.add_argument("--list-hardware", action="store_true", help="print the hardware catalog and exit")
    p.add_argument("--output-json", default=None, metavar="FILE", help="write the estimate as JSON")
    p.set_defaults(func=run_estimate)
    _register_simulate(subparsers)


def _register_simulate(subparsers: argparse._SubParsersAction) -> None:
    from tokenloom.measure.workloads import add_workload_args
    from tokenloom.router.policy import POLICIES

    p = subparsers.add_parser(
        "simulate",
        help="run the real scheduler + KV cache on a virtual clock (roofline step times)",
        description=_SIMULATE_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cost_args(p)
    g = p.add_argument_group("engine (same flags as `tokenloom serve`)")
    g.add_argument("--max-num-seqs", type=int, default=EngineArgs.max_num_seqs)
    g.add_argument("--max-num-batched-tokens", type=int, default=None)
    g.add_argument("--max-model-len", type=int, default=None, help="default: the model's max_position_embeddings")
    g.add_argument("--block-size", type=int, default=EngineArgs.block_size)
    g.add_argument("--num-kv-blocks", type=int, default=None)
    g.add_argument("--kv-cache-memory", default=None, help="KV cache size, e.g. 2GiB (default: what fits)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of device memory for weights + KV when sizing the cache (default: 0.9)")
    g.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=EngineArgs.enable_chunked_prefill)
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=EngineArgs.enable_prefix_caching)
    g.add_argument("--scheduling-policy", default=EngineArgs.scheduling_policy, choices=["fcfs", "priority"])
    g.add_argument("--max-concurrency", type=int, default=None,
                   help="client keeps at most this many requests in flight (like `bench serve --max-concurrency`)")
    f = p.add_argument_group("fleet (replicas behind a router, like `serve --data-parallel-size`)")
    f.add_argument("--replicas", type=int, default=1, metavar="N",
                   help="simulate N engine replicas, each with the KV cache and limits above (default: 1)")
    f.add_argument("--router", default="cache-aware", choices=list(POLICIES),
                   help="--replicas > 1: the routing policy, the router's own code (default: cache-aware)")
    c = p.add_argument_group("calibration and validation (--hardware local)")
    c.add_argument("--calibrated", action="store_true",
                   help="--hardware local with --model DIR: use the cost model fitted to this engine's real steps "
                        "(tokenloom.sim.calibrate; measured once per machine/model/dtype/engine version, then cached)")
    c.add_argument("--recalibrate", action="store_true", help="re-run the engine calibration even if cached")
    c.add_argument("--calibration-mode", choices=["serve", "offline"], default="serve",
                   help="--calibrated: measure the engine through `tokenloom serve` and a streaming client "
                        "(predicts `bench serve`; default) or in-process (predicts offline `LLM` runs)")
    c.add_argument("--compare-with", default=None, metavar="BENCH.json",
                   help="validate: simulate the exact workload and engine flags of a `tokenloom bench serve "
                        "--launch DIR` result with the calibrated local cost model and print measured vs simulated "
                        "(median TTFT, median/P95 TPOT, output throughput) with relative errors; other workload, "
                        "engine and cost-model flags are ignored")
    c.add_argument("--tolerance", type=float, default=0.15,
                   help="--compare-with: largest acceptable |relative error| (default: 0.15)")
    add_workload_args(p, num_prompts=1000)
    o = p.add_argument_group("output")
    o.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 (keys: ttft, tpot, e2el)")
    o.add_argument("--percentiles", default="50,90,95,99", help="latency percentiles (default: 50,90,95,99)")
    o.add_argument("--show-steps", type=int, default=0, metavar="N",
                   help="print the first N steps seed-style (who was batched, how many tokens, how long)")
    o.add_argument("--output-json", default=None, metavar="FILE", help="write config, workload and results here")
    o.add_argument("--no-save-requests", action="store_true", help="leave per-request records out of the JSON")
    o.add_argument("--band", action=argparse.BooleanOptionalAction, default=True,
                   help="also simulate the band's low and high ends (engines of lesser and greater quality) and "
                        "print them beside the central figures (datasheet GPUs; default: on)")
    p.set_defaults(func=run_simulate)


_SIMULATE_DOC = """\
`tokenloom simulate`: the engine's own Scheduler and KV cache, timed by the roofline.

    tokenloom simulate --hardware h100-sxm --model llama-3-8b --workload mixed-long \\
        --num-prompts 1000 --request-rate 20 --max-num-batched-tokens 512

Each step's time is the cost model's (weights + KV bytes vs FLOPs, see `tokenloom
estimate`), so the run takes seconds whatever the hardware; queueing, chunked prefill,
preemption and prefix caching are the real ones.  Reports the same metrics as
`tokenloom bench serve` (TTFT, TPOT, ITL, E2E, throughput, goodput) on virtual time.
"""


# ---------------------------------------------------------------- estimate command
def run_estimate(args: argparse.Namespace) -> int:
    from tokenloom.measure.report import wide_console
    from tokenloom.sim.estimate import estimate
    from tokenloom.specs.model_spec import load_model_spec

    console = wide_console()
    if args.list_hardware:
        console.print(catalog_table())
        return 0
    try:
        hw = _resolve_hardware(args)
        spec = load_model_spec(args.model)
        est = estimate(
            spec, hw, None if args.dtype == "auto" else args.dtype,
            batch_sizes=args.batch_size, context_len=args.context_len, prompt_len=args.prompt_len,
            prefill_chunk=args.prefill_chunk, **_cost_model_kwargs(args),
        )
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)  # as every command reports a user's mistake
        return 2
    console.print(decode_table(est))
    console.print(explain(est, spec, hw), markup=False, soft_wrap=True)
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = est.to_dict()
        data["explanation"] = explain(est, spec, hw)
        path.write_text(json.dumps(data, indent=2), encoding="utf-8")
        console.print(f"wrote {path}", markup=False)
    return 0


# ---------------------------------------------------------------- simulate command
class _FirstSteps:
    """Observer keeping the first `n` StepEvents for the seed-style step listing."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.events: list = []

    def __call__(self, ev) -> None:
        if len(self.events) < self.n:
            self.events.append(ev)


def step_lines(events) -> list[str]:
    """'step 3  +1.35 ms  #0 decode(kv 513)  #1 prefill(512)  | waiting 12' -- the seed's step picture."""
    lines = []
    for ev in events:
        parts = []
        for e in ev.entries:
            rid = "#" + e.request_id.rsplit("-", 1)[-1]
            if e.phase == "decode":
                parts.append(f"{rid} decode(kv {e.kv_len_after})")
            else:
                parts.append(f"{rid} {e.phase}({e.num_tokens})")
        if ev.preempted:
            parts.append("preempted " + " ".join("#" + r.rsplit("-", 1)[-1] for r in ev.preempted))
        lines.append(f"step {ev.step:>4}  t={ev.start_time * 1e3:9.3f} ms  +{fmt_time(ev.duration):>10}  "
                     f"{ev.num_batched_tokens:>5} tok  " + "  ".join(parts) + f"  | waiting {ev.num_waiting}")
    return lines


def run_simulate(args: argparse.Namespace) -> int:
    from tokenloom.measure import metrics, report
    from tokenloom.measure.workloads import MIN_TOKEN_ID, workload_from_args, workload_stats
    from tokenloom.model.tools.presets import PRESETS
    from tokenloom.sim.estimate import CostModel
    from tokenloom.specs.model_spec import load_config, load_model_spec, max_position_embeddings
    from tokenloom.sim.simulator import SimConfig, Simulator

    if args.compare_with:
        from tokenloom.sim.validate import main as validate_main

        return validate_main(args)
    from tokenloom.measure.report import wide_console

    console = wide_console()
    try:
        hw = _resolve_hardware(args)
        spec = load_model_spec(args.model)
        config, _ = load_config(args.model)
        if args.calibrated:
            from tokenloom.sim.calibrate import calibrated_cost_model

            if hw.name != LOCAL:
                raise ValueError("--calibrated is a fit of this engine on this machine: use it with --hardware local")
            cm = calibrated_cost_model(args.model, args.dtype, block_size=args.block_size,
                                       mode=args.calibration_mode, refresh=args.recalibrate,
                                       log=lambda s: console.print(s, markup=False),
                                       measure=getattr(args, "measure_engine", None))  # from `tokenloom`
            console.print("calibrated: " + "; ".join(cm.calibration.summary_lines()), markup=False, soft_wrap=True)
        else:
            cm = CostModel(spec, hw, None if args.dtype == "auto" else args.dtype, **_cost_model_kwargs(args))
        sim_cfg = SimConfig(
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            max_model_len=args.max_model_len, block_size=args.block_size, num_kv_blocks=args.num_kv_blocks,
            kv_cache_memory=args.kv_cache_memory, gpu_memory_utilization=args.gpu_memory_utilization,
            enable_chunked_prefill=args.enable_chunked_prefill, enable_prefix_caching=args.enable_prefix_caching,
            scheduling_policy=args.scheduling_policy,
        )
        first = _FirstSteps(max(0, args.show_steps))
        if args.replicas != 1:
            from tokenloom.sim.fleet import FleetSimulator

            sim = FleetSimulator(cm, sim_cfg, num_replicas=args.replicas, router=args.router,
                                 model_max_positions=max_position_embeddings(config),
                                 replica_observers=[lambda k, ev: first((k, ev))])
        else:
            sim = Simulator(cm, sim_cfg, model_max_positions=max_position_embeddings(config), observers=[first])
        vocab = (MIN_TOKEN_ID, max(MIN_TOKEN_ID + 1, spec.vocab_size))
        wl_spec, reqs = workload_from_args(args, vocab, sim.max_model_len)
        slos = metrics.parse_goodput(args.goodput)
        percentiles = metrics.parse_percentiles(args.percentiles)
    except (KeyError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)  # as every command reports a user's mistake
        return 2
    sc = sim.scheduler_config
    console.print(
        f"simulate: {spec.name} ({cm.dtype}{', ' + cm.quantization + ' weights' if cm.quantization else ''}) on "
        f"{hw.name}{' x' + str(cm.tensor_parallel_size) if cm.tensor_parallel_size > 1 else ''} | "
        f"{len(reqs)} requests, workload {wl_spec.name}, "
        f"rate {wl_spec.request_rate} req/s | max_num_seqs {sc.max_num_seqs}, max_num_batched_tokens "
        f"{sc.max_num_batched_tokens}, max_model_len {sc.max_model_len}, {sim.num_kv_blocks:,} KV blocks x "
        f"{sim_cfg.block_size} tokens"
        + (f" | {args.replicas} replicas, router {args.router}" if args.replicas != 1 else ""), markup=False)
    console.print(f"cost model: {model_line(cm)}", markup=False)
    res = sim.run(reqs, seed=args.seed, max_concurrency=args.max_concurrency)
    if first.events:
        if args.replicas != 1:  # (replica, event) pairs: each line says whose step it was
            lines = [f"r{k} " + step_lines([ev])[0] for k, ev in first.events]
        else:
            lines = step_lines(first.events)
        console.print("\n".join(lines), markup=False, soft_wrap=True)
    summary = metrics.summarize(res.records, duration=res.duration_s, goodput_slos=slos, percentiles=percentiles)
    groups = metrics.summarize_by_group(res.records, duration=res.duration_s, goodput_slos=slos,
                                        percentiles=percentiles)
    report.print_summary(summary, title=f"simulate: {wl_spec.name} on {hw.name} (virtual time)", groups=groups,
                         console=console)
    steps = res.steps.summary()
    steps.update(num_kv_blocks=res.num_kv_blocks, prefix_cache_hit_rate=res.prefix_cache_hit_rate,
                 simulated_s=res.duration_s, wall_s=res.wall_time_s)
    console.print(report.dict_table(steps, title="Steps (batch quality)"))
    replicas = getattr(res, "replicas", None)
    if replicas is not None:
        console.print(replica_table(res))
    band = None
    if args.band and cm.form == "kernels" and not hasattr(cm, "calibration"):
        band = band_runs(cm, sim_cfg, args, max_position_embeddings(config), reqs, percentiles)
        band["central"] = band_figures(summary)
        console.print(band_table(band))
    if args.output_json:
        doc = report.build_report(
            "simulate",
            config={**report.args_to_config(args), "scheduler": sc, "num_kv_blocks": res.num_kv_blocks,
                    "cost_model": {"dtype": cm.dtype, "mem_efficiency": cm.mem_efficiency,
                                   "compute_efficiency": cm.compute_efficiency, "overhead_s": cm.overhead_s,
                                   "per_seq_overhead_s": cm.per_seq_overhead_s, "form": cm.form,
                                   "weight_format": cm.quantization, "kv_cache_dtype": cm.kv_format.name,
                                   "tensor_parallel_size": cm.tensor_parallel_size,
                                   **({"efficiency": cm.efficiency.to_dict()} if cm.form == "kernels" else {}),
                                   **({"calibration": cm.calibration.to_dict(with_samples=False)}
                                      if hasattr(cm, "calibration") else {})}},
            workload={"spec": wl_spec.to_dict(), "stats": workload_stats(reqs)},
            results={"summary": summary, "groups": groups, "steps": steps, **({"band": band} if band else {}),
                     **({"router": res.router, "replicas": [r.to_dict() for r in replicas]}
                        if replicas is not None else {})},
            # The "machine" is the simulated one; the host only ran the arithmetic.
            machine={"simulated": True, "hardware": hw.to_dict(), "model": spec.to_dict(),
                     "model_is_preset": args.model in PRESETS},
        )
        if not args.no_save_requests:
            doc["requests"] = report.to_jsonable([r.to_dict() for r in res.records])
            if replicas is not None:
                for d, k in zip(doc["requests"], res.replica_of):
                    d["replica"] = k
        report.write_json(args.output_json, doc)
        console.print(f"wrote {args.output_json}", markup=False)
    return 0 if summary.completed else 1


def replica_table(res) -> "object":
    """A fleet run's split: requests, steps, busy time and prefix-cache hits per replica."""
    from rich.table import Table

    t = Table(title=f"Replicas (router {res.router})")
    for col in ("replica", "requests", "steps", "busy (virtual s)", "busy share", "preemptions",
                "prefix-cache hit rate"):
        t.add_column(col, justify="right")
    for r in res.replicas:
        share = r.busy_s / res.duration_s if res.duration_s > 0 else float("nan")
        t.add_row(str(r.index), str(r.num_requests), str(r.num_steps), f"{r.busy_s:.3f}", f"{share:.0%}",
                  str(r.num_preemptions), f"{r.prefix_cache_hit_rate:.1%}")
    return t
