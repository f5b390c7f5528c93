"""Start a real `tokenloom serve` in a subprocess, wait for `/health`, stop it cleanly.

Used by `tokenloom bench serve --launch MODEL` and by tests that need a live server
(the project's rule: servers in tests are real processes on 127.0.0.1, never mocks).

    with launch_server("models/tiny", ["--max-num-seqs", "8"]) as server:
        httpx.get(server.base_url + "/health")

The server's output goes to a log file rather than a pipe: a pipe nobody reads fills up
and blocks the server mid-benchmark.  Started from the main thread on Linux, the server gets
SIGTERM when the launching process dies, SIGKILL included (`die_with_parent`), so a killed
benchmark leaves no server behind.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence

import httpx

from tokenloom.runner.worker_procs import die_with_parent


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerStartError(RuntimeError):
    """The server exited or never became healthy; the message carries its log tail."""


@dataclass
class ServerProcess:
    """A running server subprocess and where to reach it."""

    proc: subprocess.Popen
    host: str
    port: int
    log_path: Path
    cmd: list[str] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def log_tail(self, n_chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(encoding="utf-8", errors="replace")[-n_chars:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = 300.0, interval: float = 0.25) -> None:
        """Poll GET /health until 200; raise with the log tail if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        url = self.base_url + "/health"
        with httpx.Client(timeout=2.0) as client:  # one client: a new one per poll costs CPU the server needs
            while True:
                if self.proc.poll() is not None:
                    raise ServerStartError(
                        f"server exited with code {self.proc.returncode} before becoming healthy; "
                        f"command: {' '.join(self.cmd)}\n--- server log ---\n{self.log_tail()}")
                try:
                    if client.get(url).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass  # not listening yet
                if time.monotonic() > deadline:
                    self.stop()
                    raise ServerStartError(f"server not healthy after {timeout:.0f}s at {url}\n"
                                           f"--- server log ---\n{self.log_tail()}")
                time.sleep(interval)

    def stop(self, grace: float = 15.0) -> int | None:
        """SIGINT (uvicorn's graceful shutdown), then SIGTERM, then SIGKILL."""
        for sig, wait in ((signal.SIGINT, grace), (signal.SIGTERM, 5.0)):
            if self.proc.poll() is not None:
                break
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=wait)
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        return self.proc.returncode


def start_server(model: str, engine_flags: Sequence[str] = (), *, host: str = "127.0.0.1",
                 port: int | None = None, log_path: str | Path | None = None,
                 env: dict[str, str] | None = None, timeout: float = 300.0) -> ServerProcess:
    """Start `python -m tokenloom.entrypoints.cli serve MODEL` and wait until it is healthy."""
    port = port or free_port(host)
    cmd = [sys.executable, "-m", "tokenloom.entrypoints.cli", "serve", str(model),
           "--host", host, "--port", str(port), *map(str, engine_flags)]
    if log_path is None:
        fd, name = tempfile.mkstemp(prefix="tokenloom-serve-", suffix=".log")
        os.close(fd)
        log_path = name
    log_path = Path(log_path)
    full_env = dict(os.environ)
    full_env.update(env or {})
    # Unbuffered so the log tail in an error message shows the real last words.
    full_env.setdefault("PYTHONUNBUFFERED", "1")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                preexec_fn=die_with_parent(signal.SIGTERM))
    server = ServerProcess(proc=proc, host=host, port=port, log_path=log_path, cmd=cmd)
    try:
        server.wait_healthy(timeout=timeout)
    except BaseException:
        server.stop()
        raise
    return server


@contextlib.contextmanager
def launch_server(model: str, engine_flags: Sequence[str] = (), **kw) -> Iterator[ServerProcess]:
    """Context manager around `start_server`; the server is stopped on exit, errors included."""
    server = start_server(model, engine_flags, **kw)
    try:
        yield server
    finally:
        server.stop()


def engine_flags_from_args(args, *, skip: Sequence[str] = ("model",)) -> list[str]:
    """The engine flags of a parsed Namespace that differ from their defaults, spelled
    back as CLI flags, so `bench serve --launch` / `bench sweep` can pass them to `serve`."""
    import argparse

    from tokenloom.config import EngineArgs, spell_flags

    ref = EngineArgs.add_cli_args(argparse.ArgumentParser(add_help=False), with_model=False)
    return spell_flags(ref, args, skip)
