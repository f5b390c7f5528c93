"""`tokenloom serve --data-parallel-size N`: N engine replicas behind one router.

    front process (the user's host:port)          replica processes (127.0.0.1, free ports)
    ┌───────────────────────────────┐        ┌─> tokenloom serve ... --port p0   (own KV pool)
    │ router: cache-aware policy,   │ ───────┼─> tokenloom serve ... --port p1   (own KV pool)
    │ /health, /metrics (engine=i)  │        └─> ...
    └───────────────────────────────┘

Each replica is a plain `tokenloom serve` with the user's engine and server flags, so it
loads its own copy of the weights, owns its KV cache and runs its own scheduler.  Compute is
split, not shared: on CPU each replica gets `cores // N` threads (unless --num-threads was
given) and 1/N of the KV budget one engine would take; on CUDA each gets its own device(s)
when there are enough, else they share one device and 1/N of its free memory each.

The front process waits until every replica is healthy, then serves the router on the
user's address.  `/metrics` carries every replica's series labelled `engine="<i>"` plus the
router's own.  On SIGINT/SIGTERM the router stops first (in-flight requests finish through
the still-running replicas), then the replicas are stopped; a replica also gets SIGTERM
from the kernel if the front process dies without cleaning up, SIGKILL included (Linux:
`runner.worker_procs.die_with_parent`), so none outlives it -- nor its tensor-parallel
workers, which die with their replica.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import httpx

from tokenloom.config import spell_flags as config_spell_flags
from tokenloom.router.policy import DEFAULT_BALANCE_THRESHOLD
from tokenloom.router.server import RouterServer, build_router_server
from tokenloom.runner.worker_procs import die_with_parent
from tokenloom.specs.placement import placement

logger = logging.getLogger("tokenloom.router")

# Flags each replica must not inherit from the front: where it listens, how many replicas
# there are, and a rendezvous port that N tensor-parallel groups cannot share.
_NOT_FORWARDED = frozenset({"help", "model", "model_tag", "host", "port", "data_parallel_size",
                            "distributed_init_port", "num_threads", "disable_access_log"})


def spell_flags(parser: argparse.ArgumentParser, args: argparse.Namespace, skip=_NOT_FORWARDED) -> list[str]:
    """The flags a replica runs with: what the user asked of the front (`config.spell_flags`)."""
    return config_spell_flags(parser, args, skip)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Replica:
    index: int
    port: int
    proc: subprocess.Popen

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def start_replicas(args: argparse.Namespace, flags: list[str]) -> list[Replica]:
    replicas = []
    for i, place in enumerate(placement(args, args.data_parallel_size)):
        port = _free_port()
        cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve",
               *([args.model] if args.model else []), "--host", "127.0.0.1", "--port", str(port),
               "--disable-access-log",  # the router logs each request once
               *place.flags, *flags]
        env = {**os.environ, **place.env, "PYTHONUNBUFFERED": "1"}
        # SIGTERM when the front dies: a replica stops as on Ctrl-C, its workers with it
        proc = subprocess.Popen(cmd, env=env, preexec_fn=die_with_parent(signal.SIGTERM))
        replicas.append(Replica(i, port, proc))
    return replicas


def wait_healthy(replicas: list[Replica], timeout: float) -> None:
    """Until every replica's /health is 200; RuntimeError if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    waiting = list(replicas)
    with httpx.Client(timeout=2.0) as http:  # one client: building one per poll costs real CPU
        while waiting:
            for r in list(waiting):
                if r.proc.poll() is not None:
                    raise RuntimeError(f"replica {r.index} exited with status {r.proc.returncode} while starting")
                with contextlib.suppress(httpx.HTTPError):
                    if http.get(r.url + "/health").status_code == 200:
                        waiting.remove(r)
            if waiting and time.monotonic() > deadline:
                raise RuntimeError(f"replicas {[r.index for r in waiting]} not healthy after {timeout:.0f}s")
            if waiting:
                time.sleep(0.25)


def stop_replicas(replicas: list[Replica], grace: float) -> None:
    """SIGINT all (each finishes or aborts its in-flight requests), then SIGKILL stragglers."""
    for r in replicas:
        if r.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                r.proc.send_signal(signal.SIGINT)
    deadline = time.monotonic() + grace + 5.0
    for r in replicas:
        with contextlib.suppress(subprocess.TimeoutExpired):
            r.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        if r.proc.poll() is None:
            r.proc.kill()
            r.proc.wait()


def watch_replicas(replicas: list[Replica], server: RouterServer, stop: threading.Event) -> None:
    """Report each replica that exits while serving (the router already routes around it);
    once none is left, stop the front so that it exits non-zero for a supervisor to restart."""
    gone: set[int] = set()
    while not stop.wait(1.0):
        for r in replicas:
            if r.index not in gone and r.proc.poll() is not None:
                gone.add(r.index)
                print(f"error: replica {r.index} exited with status {r.proc.returncode}", file=sys.stderr, flush=True)
        if len(gone) == len(replicas):
            print("error: every replica has exited; stopping", file=sys.stderr, flush=True)
            server.should_exit = True
            return


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def serve_data_parallel(args: argparse.Namespace, reference: argparse.ArgumentParser,
                        start_timeout: float = 1800.0) -> int:
    """Run the front process: start the replicas, route over them until SIGINT/SIGTERM, stop them.
    `reference` is a parser with the serve flags and their defaults (what replicas inherit)."""
    flags = spell_flags(reference, args)
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a SIGTERM while replicas load: stop them
    replicas: list[Replica] = []
    try:
        replicas = start_replicas(args, flags)
        wait_healthy(replicas, start_timeout)
        print(f"{len(replicas)} replicas healthy: " + ", ".join(r.url for r in replicas), file=sys.stderr, flush=True)
        routing = argparse.Namespace(policy="cache-aware", balance_threshold=DEFAULT_BALANCE_THRESHOLD,
                                     health_interval=2.0, host=args.host, port=args.port, log_level=args.log_level,
                                     disable_access_log=args.disable_access_log)
        server, _ = build_router_server([r.url for r in replicas], routing, engine_metrics=True,
                                        grace=max(0.0, args.shutdown_timeout) + 5.0)
        signal.signal(signal.SIGTERM, previous)  # uvicorn handles signals from here on
        stop = threading.Event()
        watcher = threading.Thread(target=watch_replicas, args=(replicas, server, stop), daemon=True)
        watcher.start()
        try:
            server.run()
        finally:
            stop.set()
        all_gone = all(r.proc.poll() is not None for r in replicas)
        return 1 if all_gone or not server.started else 0
    except KeyboardInterrupt:
        print("interrupted; stopping the replicas", file=sys.stderr)
        return 0
    except RuntimeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, _interrupt)  # a second SIGTERM must not orphan the replicas mid-stop
        try:
            stop_replicas(replicas, max(0.0, args.shutdown_timeout))
        except KeyboardInterrupt:  # asked twice: no more grace
            for r in replicas:
                with contextlib.suppress(ProcessLookupError):
                    r.proc.kill()
                r.proc.wait()
        signal.signal(signal.SIGTERM, previous)
