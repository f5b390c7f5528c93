"""`tokenloom bench ...`: the benchmark subcommands.

    tokenloom bench serve      --launch MODEL | --base-url URL   streaming client: TTFT/TPOT/ITL/E2E, goodput
    tokenloom bench throughput --model MODEL [--baseline hf]     offline LLM.generate vs HF generate
    tokenloom bench latency    --model MODEL --batch-size N      one batch, fixed in/out: step latency
    tokenloom bench roofline   --model MODEL                     decode step vs bandwidth/FLOP rooflines
    tokenloom bench sweep      --model MODEL                     grid over the batching knobs

Heavy imports (torch, the engine, httpx) happen inside each command so that `tokenloom
--help` stays fast and a command whose dependencies are missing cannot break the others.
"""

from __future__ import annotations

import argparse
from typing import Callable

from tokenloom.measure.workloads import add_workload_args


def _add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--output-json", default=None, metavar="FILE", help="write config, workload, machine and results here")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _add_slo_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs for goodput, e.g. --goodput ttft:500 tpot:50 e2el:5000 (keys: ttft, tpot, e2el)")
    p.add_argument("--percentiles", default="50,90,95,99", help="latency percentiles to report (default: 50,90,95,99)")


def _lazy(module: str, func: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        import importlib

        return getattr(importlib.import_module(module), func)(args)

    return run


def register(subparsers: argparse._SubParsersAction) -> None:
    from tokenloom.config import EngineArgs

    bench = subparsers.add_parser("bench", help="benchmarks: serve, throughput, latency, roofline, sweep",
                                  description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = bench.add_subparsers(dest="bench_command", metavar="BENCHMARK")
    bench.set_defaults(func=lambda args: (bench.print_help(), 2)[1])

    # ---- serve --------------------------------------------------------
    p = sub.add_parser("serve", help="online benchmark against an OpenAI-compatible /v1/completions server",
                       description="Stream a workload at a server and report TTFT, TPOT, ITL, E2E latency, "
                                   "throughput and goodput.  Engine flags are passed to the server with --launch.")
    target = p.add_argument_group("target")
    target.add_argument("--base-url", default=None, help="server to benchmark, e.g. http://127.0.0.1:8000")
    target.add_argument("--launch", default=None, metavar="MODEL",
                        help="start `tokenloom serve MODEL` (with the engine flags given here) on a free port, "
                             "benchmark it, stop it")
    target.add_argument("--served-model-name", default=None, help="`model` field to send (default: the server's first model)")
    target.add_argument("--vocab-size", type=int, default=None,
                        help="draw prompt token ids below this (default: from --tokenizer or the --launch model)")
    target.add_argument("--max-concurrency", type=int, default=None, help="at most this many requests in flight")
    target.add_argument("--num-warmups", type=int, default=1, help="untimed requests sent first (default: 1)")
    target.add_argument("--request-timeout", type=float, default=None, help="per-request timeout in s (default: none)")
    target.add_argument("--server-timeout", type=float, default=300.0, help="--launch: seconds to wait for /health")
    target.add_argument("--server-log", default=None, help="--launch: write the server's output here")
    target.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                        help="--launch: start N engine replicas behind the cache-aware router "
                             "(`tokenloom serve --data-parallel-size N`; default: 1)")
    target.add_argument("--no-save-requests", action="store_true", help="leave per-request timelines out of the JSON")
    EngineArgs.add_cli_args(p, with_model=False)  # first: its --seed also seeds the workload
    add_workload_args(p)
    _add_slo_args(p)
    _add_output_args(p)
    p.set_defaults(func=_lazy("tokenloom.bench.serve", "main"))

    # ---- throughput ---------------------------------------------------
    p = sub.add_parser("throughput", help="offline throughput of LLM.generate (optionally vs HF transformers)",
                       description="Send the whole workload to LLM.generate at once and report requests/s, "
                                   "output tokens/s, total tokens/s, batch occupancy and peak RSS.  "
                                   "--baseline hf runs the same requests through transformers' generate.")
    EngineArgs.add_cli_args(p)
    add_workload_args(p)
    p.add_argument("--baseline", choices=["none", "hf"], default="none",
                   help="also run HF transformers generate on the same requests (default: none)")
    p.add_argument("--baseline-batch-size", type=int, default=8, help="HF static batch size (default: 8)")
    _add_output_args(p)
    p.set_defaults(func=_lazy("tokenloom.bench.throughput", "main"))

    # ---- latency ------------------------------------------------------
    p = sub.add_parser("latency", help="latency of one batch of N requests with fixed input/output lengths",
                       description="Run a batch of --batch-size requests of --input-len prompt tokens and "
                                   "--output-len generated tokens, --num-iters times; report batch latency, "
                                   "prefill (TTFT) and decode step times from the engine's step events.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--num-iters", type=int, default=3)
    p.add_argument("--num-iters-warmup", type=int, default=1)
    p.add_argument("--structured-output", choices=["json_object", "json_schema", "regex"], default=None,
                   help="also run every iteration with each request's output constrained by this grammar "
                        "(alternating with the unconstrained batch) and report what the masks cost per decode step")
    _add_output_args(p)
    p.set_defaults(func=_lazy("tokenloom.bench.latency", "main"))

    # ---- roofline -----------------------------------------------------
    p = sub.add_parser("roofline", help="engine decode step time vs this machine's bandwidth/FLOP rooflines",
                       description="Measure memory bandwidth and matmul FLOP/s, compute the model's bytes and "
                                   "FLOPs per decode step, and time the engine's decode steps at several batch "
                                   "sizes and context lengths: achieved vs roofline, and engine overhead.")
    EngineArgs.add_cli_args(p)
    p.add_argument("--batch-sizes", default="1,8,32", help="decode batch sizes (default: 1,8,32)")
    p.add_argument("--context-lens", default="128,512", help="context lengths (default: 128,512)")
    p.add_argument("--decode-steps", type=int, default=8, help="decode steps timed per point (default: 8)")
    p.add_argument("--max-tries", type=int, default=3,
                   help="times a point is taken while the bandwidth/FLOP readings around it differ by "
                        "more than 10%% (default: 3)")
    p.add_argument("--bandwidth-mib", type=int, default=None, help="bandwidth test buffer size (default: microbench's)")
    _add_output_args(p)
    p.set_defaults(func=_lazy("tokenloom.bench.roofline", "main"))

    # ---- sweep --------------------------------------------------------
    p = sub.add_parser("sweep", help="grid over --max-num-seqs x --max-num-batched-tokens (x chunked prefill)",
                       description="Run the workload once per grid point (offline engine honoring arrival "
                                   "times, or a launched server) and plot throughput against P95 TPOT and "
                                   "P95 TTFT: the seed's 'why max-num-batched-tokens matters more'.")
    EngineArgs.add_cli_args(p)
    add_workload_args(p)
    p.add_argument("--max-num-seqs-list", default="4,16,64", help="values of --max-num-seqs (default: 4,16,64)")
    p.add_argument("--max-num-batched-tokens-list", default="128,512,2048",
                   help="values of --max-num-batched-tokens (default: 128,512,2048)")
    p.add_argument("--chunked-prefill", choices=["on", "off", "both"], default="on",
                   help="chunked prefill setting(s) to sweep (default: on)")
    p.add_argument("--mode", choices=["offline", "serve"], default="offline",
                   help="offline: in-process engine with arrival times; serve: launch a server per point")
    p.add_argument("--max-concurrency", type=int, default=None, help="serve mode: client concurrency limit")
    p.add_argument("--output-csv", default=None, metavar="FILE")
    p.add_argument("--output-png", default=None, metavar="FILE", help="throughput vs P95 TPOT / P95 TTFT plot")
    _add_slo_args(p)
    _add_output_args(p)
    p.set_defaults(func=_lazy("tokenloom.bench.sweep", "main"))
