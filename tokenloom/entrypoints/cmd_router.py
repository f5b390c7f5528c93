"""CLI: `tokenloom router --backend URL [--backend URL ...]` -- one OpenAI endpoint in front
of several servers (tokenloom's, or any OpenAI-compatible one with a /health route).

    tokenloom router --backend http://10.0.0.7:8000 --backend http://10.0.0.8:8000 --port 9000
    tokenloom router --backend http://a:8000 --backend http://b:8000 --policy least-loaded

Exit status: 0 after a clean stop (SIGINT / SIGTERM), 1 if the port cannot be bound,
2 for bad flags.
"""

from __future__ import annotations

import argparse
import sys

from tokenloom.router.server import add_routing_args, build_router_server


def _router(args: argparse.Namespace) -> int:
    backends = [u.rstrip("/") for u in args.backend]
    bad = [u for u in backends if not u.startswith(("http://", "https://"))]
    if bad:
        print(f"error: a backend is a base URL such as http://host:8000, got {', '.join(map(repr, bad))}",
              file=sys.stderr)
        return 2
    if len(set(backends)) != len(backends):
        print("error: a backend is listed twice", file=sys.stderr)
        return 2
    server, _ = build_router_server(backends, args, grace=args.shutdown_timeout)
    server.run()
    return 0 if server.started else 1


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("router", help="route OpenAI requests over several servers (health-checked, with retries)",
                       description="An OpenAI-compatible passthrough in front of several servers: each request "
                                   "goes to the backend the policy picks, streams pass through chunk by chunk, "
                                   "dead backends leave rotation, and a request that failed before any byte "
                                   "reached the client is retried on another backend.")
    p.add_argument("--backend", action="append", required=True, metavar="URL",
                   help="base URL of an OpenAI-compatible server (repeat for each backend)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--shutdown-timeout", type=float, default=10.0,
                   help="seconds in-flight requests may take to finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("--disable-access-log", action="store_true", help="do not log one line per HTTP request")
    add_routing_args(p)
    p.set_defaults(func=_router)
