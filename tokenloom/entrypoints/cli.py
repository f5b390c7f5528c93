"""`tokenloom` command line: one subcommand per module, each module registers itself.

Every module listed in `COMMAND_MODULES` exposes `register(subparsers)`, which adds its
parser and sets `func=<callable(args) -> int | None>`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMAND_MODULES = [
    "tokenloom.entrypoints.cmd_generate",  # generate, make-model
    "tokenloom.entrypoints.cmd_serve",  # serve
    "tokenloom.entrypoints.cmd_router",  # router
    "tokenloom.bench.cli",  # bench {throughput,serve,latency,roofline,sweep}
    "tokenloom.trace.cli",  # trace
    "tokenloom.sim.cli",  # estimate, simulate
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tokenloom",
        description="tokenloom: an LLM inference engine you can watch decode.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    rc = args.func(args)
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
