"""The processes beside the engine (tensor-parallel workers): how they start, how they stay
tied to their parent, how they stop.

Start method (`choose_start_method`), decided when the workers start:

    fork   on Linux when the parent holds no CUDA context (a CUDA context does not survive
           fork).  Instant; works from any script, `if __name__ == "__main__":` or not.
    spawn  when a CUDA context exists, off Linux, or when asked
           (TOKENLOOM_WORKER_START_METHOD=spawn).  A fresh interpreter that runs only
           tokenloom's worker code: unlike multiprocessing's spawn it never re-imports the
           user's main module, so an unguarded script works here too.

What fork inherits, and what is done about it:

    OpenMP   GNU libgomp's thread pool belongs to the thread that ran the parent's parallel
             regions, and its threads do not exist in the child: the first parallel region of
             the child's main thread waits for them forever (torch's CPU kernels, MKL).  The
             worker therefore runs on a new thread, whose first parallel region makes a new pool.
    threads  only the forking thread exists in the child; the worker touches no lock of the
             parent's other threads (imports, logging and stdio are reset by Python at fork).
    tokenizers  HF tokenizers prints a warning in a child forked after its thread pool ran;
             the child is started with TOKENIZERS_PARALLELISM=false (it never tokenizes).

Tied to the parent, however the parent ends (SIGKILL included):

    death pipe   the parent holds the only write end; a thread in each worker reads the other
                 end and exits the worker the moment it reads end-of-file.
    PDEATHSIG    on Linux, when the workers are started from the main thread, the kernel also
                 sends them SIGKILL when the parent dies (the signal follows the thread that
                 started a child, so never from a thread that may end first).
    start        each worker writes one byte on its own pipe once it runs our code; the parent
                 waits for that byte while watching for the pipe's end-of-file (the worker
                 exited), so a worker that cannot start is an error within a second.
    stop         join with a timeout, then SIGKILL; workers ignore SIGINT (a Ctrl-C reaches
                 the whole process group: the parent decides, the workers follow) and die
                 on SIGTERM whatever handler the parent had installed before the fork.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
import selectors
import signal
import subprocess
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

START_METHOD_ENV = "TOKENLOOM_WORKER_START_METHOD"
START_METHODS = ("fork", "spawn")
# A worker that neither starts nor exits within this long is an error (a spawned one imports
# torch first: seconds, more on a loaded machine).
START_TIMEOUT_S = 300.0
EXIT_PARENT_GONE = 3  # a worker's status when it left because its parent was gone

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
try:  # resolved once here, never in a child between fork and exec
    _prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
except (OSError, AttributeError):
    _prctl = None


class WorkerStartError(RuntimeError):
    """A worker exited, or never ran, before it began its work."""


def cuda_initialized() -> bool:
    """Whether this process holds a CUDA context (no torch import: none)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def choose_start_method() -> str:
    """"fork" or "spawn" for the workers started now (see the module docstring)."""
    asked = os.environ.get(START_METHOD_ENV, "").strip().lower()
    if asked:
        if asked not in START_METHODS:
            raise ValueError(f"{START_METHOD_ENV}={asked!r}: expected one of {', '.join(START_METHODS)}")
        return asked
    if sys.platform != "linux" or cuda_initialized():
        return "spawn"
    return "fork"


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None] | None:
    """A `preexec_fn` for `subprocess.Popen` on Linux: the child gets `sig` when this process
    dies (prctl PR_SET_PDEATHSIG; a child orphaned before it took effect exits at once).
    None off Linux, or off the main thread: the signal follows the thread that started the
    child, and a thread may end long before the process does."""
    if _prctl is None or threading.current_thread() is not threading.main_thread():
        return None
    parent = os.getpid()
    prctl = _prctl

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig))
        if os.getppid() != parent:
            os._exit(EXIT_PARENT_GONE)

    return preexec


@dataclass(frozen=True)
class _Tie:
    """What ties a worker to its parent (picklable; file descriptors valid in the worker)."""

    parent_pid: int
    death_fd: int  # read end of the death pipe: end-of-file when the parent is gone
    ready_fd: int  # write end of this worker's start pipe
    deathsig: bool  # also ask the kernel for SIGKILL when the parent dies
    close_fds: tuple[int, ...] = ()  # fork: the parent's ends, inherited, closed first


class WorkerProcess:
    """One started worker, whichever the start method: pid, is_alive(), exitcode (negative:
    killed by that signal), join(timeout), kill()."""

    def __init__(self, name: str, method: str, proc: mp.process.BaseProcess | subprocess.Popen, ready_fd: int):
        self.name = name
        self.method = method
        self._proc = proc
        self.ready_fd = ready_fd  # parent's read end of the start pipe (-1 once read)

    @property
    def pid(self) -> int:
        return self._proc.pid

    @property
    def exitcode(self) -> int | None:
        if isinstance(self._proc, subprocess.Popen):
            return self._proc.poll()
        return self._proc.exitcode

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        if isinstance(self._proc, subprocess.Popen):
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout)
        else:
            self._proc.join(timeout)

    def kill(self) -> None:
        if self.is_alive():
            with contextlib.suppress(ProcessLookupError):
                self._proc.kill()

    def __repr__(self) -> str:
        return f"<{self.name} pid {self.pid} ({self.method}) exitcode {self.exitcode}>"


class Workers:
    """The workers one engine started: start them, wait until each runs, stop them."""

    def __init__(self, method: str | None = None):
        self.method = method or choose_start_method()
        self.procs: list[WorkerProcess] = []
        self._death_r, self._death_w = os.pipe()  # not inheritable across exec; fork closes it
        self._deathsig = _prctl is not None and threading.current_thread() is threading.main_thread()
        self._closed = False

    def start(self, name: str, target: Callable[..., Any], *args: Any) -> WorkerProcess:
        """Start `target(*args)` (a module-level function: spawn pickles it by name)."""
        ready_r, ready_w = os.pipe()
        try:
            if self.method == "fork":
                tie = _Tie(os.getpid(), self._death_r, ready_w, self._deathsig,
                           close_fds=(self._death_w, ready_r))
                proc: Any = mp.get_context("fork").Process(target=_child, args=(tie, target, args), name=name,
                                                           daemon=True)
                with _fork_quietly():
                    proc.start()
            else:
                proc = _spawn(_Tie(os.getpid(), self._death_r, ready_w, self._deathsig), target, args)
        except BaseException:
            os.close(ready_r)
            raise
        finally:
            os.close(ready_w)  # the worker holds the only write end: its exit is end-of-file here
        worker = WorkerProcess(name, self.method, proc, ready_r)
        self.procs.append(worker)
        return worker

    def wait_started(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until every worker runs our code; WorkerStartError (naming the worker and its exit
        status) as soon as one exits first, or when `timeout` passes."""
        deadline = time.monotonic() + timeout
        pending = {w.ready_fd: w for w in self.procs if w.ready_fd >= 0}
        with selectors.DefaultSelector() as sel:  # not select(): a busy process may hold fds past 1024
            for fd in pending:
                sel.register(fd, selectors.EVENT_READ)
            while pending:
                left = deadline - time.monotonic()
                if left <= 0:
                    names = ", ".join(f"{w.name} (pid {w.pid})" for w in pending.values())
                    raise WorkerStartError(f"{names} did not start within {timeout:.0f}s ({self.method})")
                for key, _ in sel.select(min(left, 1.0)):
                    fd = int(key.fd)
                    sel.unregister(fd)
                    w = pending.pop(fd)
                    got = os.read(fd, 1)
                    os.close(fd)
                    w.ready_fd = -1
                    if not got:
                        w.join(5.0)
                        raise WorkerStartError(
                            f"{w.name} (pid {w.pid}, started by {self.method}) exited with status {w.exitcode} "
                            "before it started; its own error, if any, is printed above")

    def stop(self, timeout: float) -> None:
        """Wait up to `timeout` s in all for the workers to leave by themselves, then kill the rest."""
        deadline = time.monotonic() + timeout
        for w in self.procs:
            w.join(max(0.0, deadline - time.monotonic()))
        self.kill()

    def kill(self) -> None:
        """Let go of the workers at once: end-of-file on the death pipe, SIGKILL, reap."""
        self._close()
        for w in self.procs:
            w.kill()
        for w in self.procs:
            w.join(10.0)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for fd in (self._death_w, self._death_r, *(w.ready_fd for w in self.procs if w.ready_fd >= 0)):
            with contextlib.suppress(OSError):
                os.close(fd)
        for w in self.procs:
            w.ready_fd = -1


@contextlib.contextmanager
def _fork_quietly():
    """Around a fork: the child starts with TOKENIZERS_PARALLELISM=false unless the user set it
    (HF tokenizers would warn in it), and Python's warning about forking a process with threads
    is not shown (the hazards are handled: see the module docstring)."""
    set_here = "tokenizers" in sys.modules and "TOKENIZERS_PARALLELISM" not in os.environ
    if set_here:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r".*multi-threaded, use of fork\(\)", category=DeprecationWarning)
            yield
    finally:
        if set_here:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)


# A spawned worker's first words: it reads the parent's sys.path and the pickled work from
# stdin (only then can tokenloom be imported as the parent imports it) and runs it.
_BOOT = ("import pickle, sys\n"
         "path, payload = pickle.load(sys.stdin.buffer)\n"
         "sys.path[:] = path\n"
         "from tokenloom.runner.worker_procs import spawned_main\n"
         "spawned_main(payload)\n")


def _spawn(tie: _Tie, target: Callable[..., Any], args: tuple) -> subprocess.Popen:
    payload = pickle.dumps((tie, target, args))
    proc = subprocess.Popen([sys.executable, "-c", _BOOT], stdin=subprocess.PIPE,
                            pass_fds=(tie.death_fd, tie.ready_fd))
    try:
        assert proc.stdin is not None
        proc.stdin.write(pickle.dumps((list(sys.path), payload)))
        proc.stdin.close()
    except BrokenPipeError:
        pass  # it exited already: the start pipe says so
    return proc


def spawned_main(payload: bytes) -> None:
    """The entry of a spawned worker (see `_BOOT`)."""
    tie, target, args = pickle.loads(payload)
    _child(tie, target, args)


def _child(tie: _Tie, target: Callable[..., Any], args: tuple) -> None:
    """A worker's main thread: tie itself to the parent, say it runs, run `target` on a new
    thread (a fresh OpenMP pool after fork), re-raise what it raised."""
    for fd in tie.close_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a handler inherited by fork must not outlive a SIGTERM
    if tie.deathsig and _prctl is not None:
        _prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != tie.parent_pid:  # the parent died before the tie held
        os._exit(EXIT_PARENT_GONE)
    threading.Thread(target=_watch_parent, args=(tie.death_fd,), name="tokenloom-parent-watch", daemon=True).start()
    os.write(tie.ready_fd, b"1")
    os.close(tie.ready_fd)
    raised: list[BaseException] = []

    def run() -> None:
        try:
            target(*args)
        except BaseException as e:  # re-raised on the main thread: traceback and exit status 1
            raised.append(e)

    # daemon: should this thread be interrupted, the worker must not wait for its work to exit
    work = threading.Thread(target=run, name=threading.current_thread().name + "-work", daemon=True)
    work.start()
    work.join()
    if raised:
        raise raised[0]


def _watch_parent(fd: int) -> None:
    """Exit the worker at once when the parent is gone (end-of-file on the death pipe)."""
    while True:
        try:
            if not os.read(fd, 1):
                break
        except OSError:
            break
    os._exit(EXIT_PARENT_GONE)
