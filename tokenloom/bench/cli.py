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

from tokenloom.bench.workloads import add_workload_args


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
    target.add_argument("--no-save-requests", action="store_true", help="leave per-request timelines out of the JSON")
    EngineArgs.add_cli_args(p, with_model=False)  # first: its --seed also seeds the workload
    add_workload_args(p)
    _add_slo_args(p)
    _add_output_args(p)
    p.set_defaults(func=_lazy("tokenloom.bench.serve", "main"))
