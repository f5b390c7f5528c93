"""`tokenloom trace`: run prompts and watch the seed's decode happen, step by step.

    tokenloom trace --model DIR                      # the seed's prompt, greedy
    tokenloom trace --model DIR "A" "B" "C" --max-num-seqs 2 --max-num-batched-tokens 16 \\
        --html trace.html --png trace.png --json trace.json
    tokenloom trace --load trace.json                # re-render a saved trace, no model

Engine flags are `tokenloom generate`'s; sampling flags too (greedy by default).

The command lives with the other commands (it runs `LLM` and takes `generate`'s flags);
`tokenloom.trace` keeps what it calls: recording the step events and rendering them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tokenloom.config import EngineArgs
from tokenloom.entrypoints.cmd_generate import add_sampling_args, sampling_params_from_args
from tokenloom.trace.text import SEED_PROMPT

DEFAULT_MAX_TOKENS = 8  # the seed walks through 5 decode steps; a trace is for reading, not for throughput


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "trace",
        help="walk through prefill and decode step by step (console, HTML, PNG, JSON)",
        description="Run prompts through the engine and print, in the seed's terms, every step: tokenization, "
                    "prefill (chunks), each decode step's fed token, KV cache growth and sampled token, the batch "
                    "composition per step, and TTFT/TPOT/tokens/s.",
    )
    p.add_argument("prompts", nargs="*", help=f"prompt text(s); default: {SEED_PROMPT}")
    out = p.add_argument_group("trace output")
    out.add_argument("--html", metavar="FILE", default=None, help="write a self-contained HTML timeline")
    out.add_argument("--png", metavar="FILE", default=None, help="write the timeline as a PNG image")
    out.add_argument("--json", metavar="FILE", default=None, help="write the raw step events + request metadata")
    out.add_argument("--load", metavar="FILE", default=None, help="render a trace saved with --json instead of running")
    out.add_argument("--no-steps", dest="steps", action="store_false", help="leave out the per-step table")
    out.add_argument("--batches", action=argparse.BooleanOptionalAction, default=None,
                     help="print the seed-style batch composition per step (default: with several requests)")
    EngineArgs.add_cli_args(p)
    add_sampling_args(p)
    p.set_defaults(func=run, max_tokens=DEFAULT_MAX_TOKENS)


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from tokenloom.trace.recorder import Trace
    from tokenloom.trace.text import render_text

    # Piped into a file or a pager, rich would assume 80 columns and squeeze the step table;
    # a wider page reads better there.  A real terminal keeps its own width.
    console = Console(width=None if sys.stdout.isatty() or os.environ.get("COLUMNS") else 132)
    if args.load:
        trace = Trace.from_dict(json.loads(Path(args.load).read_text(encoding="utf-8")))
    else:
        trace = record(args)
    render_text(trace, console, steps=args.steps, batches=args.batches)
    write_outputs(trace, html=args.html, png=args.png, json_path=None if args.load else args.json, console=console)
    return 1 if any(r.error for r in trace.requests) and not trace.events else 0


def record(args: argparse.Namespace):
    from tokenloom.entrypoints.llm import LLM
    from tokenloom.trace.recorder import run_trace

    prompts = args.prompts or [SEED_PROMPT]
    llm = LLM(**vars(EngineArgs.from_cli_args(args)))
    return run_trace(llm, prompts, sampling_params_from_args(args))


def write_outputs(trace, *, html: str | None, png: str | None, json_path: str | None, console=None) -> None:
    def note(msg: str) -> None:
        if console is not None:
            console.print(f"[dim]{msg}[/]")
        else:
            print(msg, file=sys.stderr)

    if json_path:
        Path(json_path).write_text(json.dumps(trace.to_dict(), ensure_ascii=False, indent=1), encoding="utf-8")
        note(f"wrote {json_path} (step events + request metadata)")
    if html:
        from tokenloom.trace.html import render_html

        Path(html).write_text(render_html(trace), encoding="utf-8")
        note(f"wrote {html} (timeline, self-contained)")
    if png:
        from tokenloom.trace.png import render_png

        render_png(trace, png)
        note(f"wrote {png} (timeline image)")
