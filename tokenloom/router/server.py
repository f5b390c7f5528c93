"""The router as a uvicorn server, and the command-line flags that configure it.

Shared by `tokenloom router` (backends anywhere) and `tokenloom serve --data-parallel-size N`
(backends are local replicas the front process started).
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import threading

import uvicorn

from tokenloom.router.app import Router, build_router_app
from tokenloom.router.policy import DEFAULT_BALANCE_THRESHOLD, POLICIES, make_policy


def add_routing_args(p: argparse.ArgumentParser, *, default_policy: str = "cache-aware") -> None:
    g = p.add_argument_group("routing")
    g.add_argument("--policy", default=default_policy, choices=list(POLICIES),
                   help=f"how a request picks its backend (default {default_policy}): cache-aware = longest "
                        "prompt-prefix match, least-loaded when imbalanced; least-loaded = fewest requests in "
                        "flight; round-robin = in turn")
    g.add_argument("--balance-threshold", type=int, default=DEFAULT_BALANCE_THRESHOLD,
                   help="cache-aware: in-flight requests by which the best prefix match may exceed the least "
                        f"loaded backend before the least loaded is chosen instead (default {DEFAULT_BALANCE_THRESHOLD})")
    g.add_argument("--health-interval", type=float, default=2.0,
                   help="seconds between health checks of each backend (default 2)")


class CleanExitServer(uvicorn.Server):
    """uvicorn that, after a signal-driven shutdown, returns instead of re-raising the signal
    (uvicorn re-raises it once done, so SIGTERM would end the process with -15 and SIGINT with
    a KeyboardInterrupt): the caller cleans up (stops replicas, the engine) and exits with
    status 0.  The router's server, and the base of the OpenAI server's."""

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # tests run servers in threads; signals belong to the main one
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


class RouterServer(CleanExitServer):
    """The router's uvicorn server (`build_router_server`)."""


def build_router_server(backends: list[str], args: argparse.Namespace, *, engine_metrics: bool = False,
                        grace: float = 10.0) -> tuple[RouterServer, Router]:
    """A (not yet started) router over `backends`, configured by parsed routing and server
    flags (`--policy`, `--balance-threshold`, `--health-interval`, `--host`, `--port`,
    `--log-level`, `--disable-access-log`)."""
    options = {"balance_threshold": args.balance_threshold} if args.policy == "cache-aware" else {}
    policy = make_policy(args.policy, len(backends), **options)
    router = Router(backends, policy, health_interval=args.health_interval, engine_metrics=engine_metrics)
    config = uvicorn.Config(build_router_app(router), host=args.host, port=args.port,
                            log_level=getattr(args, "log_level", "info"),
                            access_log=not getattr(args, "disable_access_log", False),
                            timeout_graceful_shutdown=grace)
    return RouterServer(config), router
