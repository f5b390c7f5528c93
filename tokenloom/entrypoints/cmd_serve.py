"""CLI: `tokenloom serve [MODEL]` -- the OpenAI-compatible server.

    tokenloom serve                         # the bundled model
    tokenloom serve ./my-model --port 8001 --max-num-seqs 32 --api-key secret

Engine flags are the same as `tokenloom generate` (vLLM spellings); server flags are in
`add_server_args` below.  Exit status: 0 after a clean
stop (SIGINT / SIGTERM), 1 if the model cannot be loaded, the port cannot be bound, or the
engine died (--max-failed-steps failed steps in a row, or a broken device).
"""

from __future__ import annotations

import argparse
import signal
import sys

from tokenloom.config import EngineArgs
from tokenloom.entrypoints.openai.limits import add_limit_args


def _serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            print(f"error: model given twice ({args.model_tag!r} and --model {args.model!r})", file=sys.stderr)
            return 2
        args.model = args.model_tag
    if args.model is None:
        from tokenloom.bundled import BUNDLED_MODEL_DIR

        if not (BUNDLED_MODEL_DIR / "config.json").exists():
            print(f"error: no MODEL given and the bundled model is missing ({BUNDLED_MODEL_DIR}); "
                  "pass a model directory, e.g. one made by `tokenloom make-model`", file=sys.stderr)
            return 2
    dp = getattr(args, "data_parallel_size", 1)
    if dp < 1:
        print(f"error: --data-parallel-size must be at least 1, got {dp}", file=sys.stderr)
        return 2
    if dp > 1:  # N replicas of this very command behind a router
        from tokenloom.entrypoints.data_parallel import serve_data_parallel

        return serve_data_parallel(args, _replica_reference_parser())
    # Imported here so `tokenloom --help` and other subcommands don't pay for FastAPI/uvicorn.
    from tokenloom.entrypoints.openai.api_server import build_server

    # Loading a model takes a while; a SIGTERM meanwhile is a request to stop, not a crash.
    # (Once uvicorn runs it installs its own handlers, and restores this one when done.)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        server, engine = build_server(args)
    except KeyboardInterrupt:
        print("interrupted while loading the model; exiting", file=sys.stderr)
        return 0
    # A bad path or flag combination raises on to `cli.main`: one `error:` line, status 2,
    # as for every other subcommand.
    print(engine.engine.summary(), file=sys.stderr, flush=True)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    if server.engine_failed is not None:
        print(f"error: {server.engine_failed}", file=sys.stderr)
        return 1
    return 0


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _replica_reference_parser() -> argparse.ArgumentParser:
    """The serve flags with their defaults: what a data-parallel replica inherits is what differs."""
    p = argparse.ArgumentParser(add_help=False)
    add_server_args(p)
    EngineArgs.add_cli_args(p)
    return p


def add_server_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000)
    g.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on /v1 routes")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use for the model, all listed by /v1/models; default: MODEL as "
                        "given for a hub id, the directory's name for a path (the path itself is still "
                        "accepted), tokenloom/py-tiny for the bundled model")
    g.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM; then they are aborted")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    g.add_argument("--disable-access-log", action="store_true", help="do not log one line per HTTP request")
    g.add_argument("--max-failed-steps", type=int, default=3,
                   help="failed engine steps in a row after which the engine is declared dead "
                        "(/health 503, exit status 1); a broken device is fatal at once")
    g.add_argument("--exit-on-engine-failure", action=argparse.BooleanOptionalAction, default=True,
                   help="exit (status 1) when the engine dies, for a supervisor to restart; with "
                        "--no-exit-on-engine-failure the server stays up answering 503")
    g.add_argument("--tool-call-parser", default=None, choices=["hermes", "llama3_json"],
                   help="read the model's own tool calls for tool_choice \"auto\": hermes (Hermes, Qwen2.5 "
                        "<tool_call> JSON) or llama3_json (Llama 3.1 JSON); default: chosen by the chat "
                        "template's family, and with none that fits \"auto\" answers in text")
    g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="LoRA adapters (peft directories) to serve from the start, each as name=path or "
                        "'{\"name\": ..., \"path\": ...}'; requests pick one by name as their model "
                        "(needs --enable-lora; docs/lora.md)")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split a thinking model's <think>...</think> from its answer: chat messages and deltas "
                        "carry it as reasoning_content, /v1/responses as a reasoning item; structured output "
                        "and tool calls then apply to the answer only (docs/reasoning.md)")
    g.add_argument("--max-stored-responses", type=int, default=1024,
                   help="responses /v1/responses keeps in memory for previous_response_id and GET, least "
                        "recently used dropped first (default 1024; 0: store none; docs/responses.md)")
    g.add_argument("--dashboard", action=argparse.BooleanOptionalAction, default=True,
                   help="serve the live step picture at /dashboard (guarded by --api-key: open "
                        "/dashboard?key=KEY); --no-dashboard answers 404 there")
    add_limit_args(p)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API",
                       description="Serve MODEL (a Hugging Face directory or hub id; default: the bundled model) "
                                   "over an OpenAI-compatible HTTP API with SSE streaming and Prometheus metrics.")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF model directory or hub id (default: the bundled model)")
    add_server_args(p)
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1, metavar="N",
                   help="run N engine replicas (processes, each with its own KV cache and share of the CPU "
                        "threads or its own GPU) behind a prefix-cache-aware router on --host/--port")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=_serve)
