"""`tokenloom` command line: one subcommand per module, each module registers itself.

Every module listed in `COMMAND_MODULES` exposes `register(subparsers)`, which adds its
parser and sets `func=<callable(args) -> int | None>`.

Errors: a user's ordinary mistake (a path that is not a model, a flag value the model cannot
take, a server that would not start) is reported by `main` for every subcommand alike, as one
`error: ...` line on stderr and exit status 2, the way argparse reports a bad flag; see
`USER_ERRORS`.  Anything else is a bug and keeps its traceback.  `TOKENLOOM_TRACEBACK=1` shows the
traceback of a user error too.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMAND_MODULES = [
    "tokenloom.entrypoints.cmd_generate",  # generate, make-model
    "tokenloom.entrypoints.cmd_serve",  # serve
    "tokenloom.entrypoints.cmd_router",  # router
    "tokenloom.bench.cli",  # bench {throughput,serve,latency,roofline,sweep}
    "tokenloom.entrypoints.cmd_trace",  # trace
    "tokenloom.sim.cli",  # estimate, simulate
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom",
        description="tokenloom: an LLM inference engine you can watch decode.",
        epilog="A mistake in a command (a path that is not a model, a flag value the model cannot take) "
               "is reported as one 'error:' line with exit status 2; TOKENLOOM_TRACEBACK=1 shows the traceback.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    # The simulator's commands calibrate against the real engine when nothing is cached; the run
    # (server, benchmark client) stands above the simulator, so this command hands it in.
    parser.set_defaults(measure_engine=measure_engine)
    return parser


def measure_engine(*args, **kwargs):
    """`tokenloom.entrypoints.calibration_run.run_calibration` (a `sim.calibration_plan.MeasureEngine`),
    imported only when a calibration is measured: it loads the server and the benchmarks."""
    from tokenloom.entrypoints.calibration_run import run_calibration

    return run_calibration(*args, **kwargs)


# What the engine, the loader and the commands raise for a mistake in what the user asked for:
# ValueError for a flag value that cannot work (`--max-model-len` over the model's limit, an
# impossible flag combination, a bad sampling parameter: SamplingParamError is one), OSError for a
# path (FileNotFoundError: not a directory, no config.json, no weights; huggingface_hub's errors
# for a hub id that cannot be fetched are OSErrors too).
USER_ERRORS: tuple[type[BaseException], ...] = (ValueError, OSError)
# By module and class name: a server that `bench serve --launch` started and that exited (its
# message carries the server's own error line).  Looked up only when raised, so that importing
# this module does not import the benchmarks.
USER_ERROR_NAMES = {("tokenloom.bench.launcher", "ServerStartError")}


def is_user_error(e: BaseException) -> bool:
    """Whether `e` reports a mistake in the command line rather than a bug in tokenloom."""
    return isinstance(e, USER_ERRORS) or (type(e).__module__, type(e).__qualname__) in USER_ERROR_NAMES


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except Exception as e:
        if not is_user_error(e) or os.environ.get("TOKENLOOM_TRACEBACK") == "1":
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
