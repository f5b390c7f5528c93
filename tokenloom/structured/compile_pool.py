"""A small pool of long-lived worker processes that compile grammars, each of which can be
killed: the server's way of bounding what one grammar may cost.

Compiling a grammar can take seconds to minutes of CPU (a JSON schema nested 400 deep takes
~16 s on a 1,024-token vocabulary), and xgrammar gives no way to interrupt it.  A thread
cannot be stopped, so the server compiles in processes (`compile_worker.py`) and holds each
compilation to three bounds:

- time: a compilation that outlives `compile_seconds` has its worker killed (SIGKILL) and
  replaced, and fails with `CompileTimeout`;
- width: at most `workers` compilations run at once (one core each); a job waits in a FIFO
  queue at most `wait_seconds` for a free worker (then `CompilersBusy`), and at most
  `max_queued` jobs wait at all;
- interest: a job nobody waits for any more (`CompileJob.cancel`, when its clients have
  disconnected) is dropped from the queue, or its worker is killed if it already runs.

Each worker is driven by a thread of its own in this process (a "slot"), which sends the
spec, polls for the answer, the deadline and cancellation every 50 ms, and turns the
worker's serialized `CompiledGrammar` back into an object (`decode`) so that neither the
event loop nor the caller pays for it.

Workers are forked by multiprocessing's *forkserver* (a clean single-threaded process that
has preloaded xgrammar), never by this multi-threaded process itself, so they start in
milliseconds without inheriting locks held by other threads.  They are started on first
use, are daemonic (killed when this interpreter exits), and kill themselves when their
server's end of their lifeline pipe closes (`compile_worker._exit_with_server`), so none
outlives a server killed with SIGKILL either.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable

logger = logging.getLogger("tokenloom.structured")

POLL_SECONDS = 0.05
START_TIMEOUT_SECONDS = 300.0  # the first start also starts the forkserver, which imports torch


class CompileError(Exception):
    """Why a pooled compilation gave no grammar; `code` is the OpenAI error code to answer with."""

    code = "grammar_compile_failed"


class SpecError(CompileError):
    """The spec does not compile (xgrammar's message)."""

    code = "invalid_value"


class CompileTimeout(CompileError):
    """The compilation outlived the time limit; its worker was killed."""

    code = "limit_exceeded"


class CompilersBusy(CompileError):
    """No worker came free within the wait limit, or too many jobs wait already: retry later."""

    code = "grammar_compilers_busy"


class CompileAbandoned(CompileError):
    """Nobody waits for this compilation any more (its clients left, or the pool closed)."""


class WorkerFailed(CompileError):
    """The worker died or failed inside xgrammar while compiling this spec."""


class CompileJob:
    """One spec to compile; `future` gets `decode(serialized)` or a `CompileError`."""

    def __init__(self, kind: str, text: str, decode: Callable[[str], Any], wait_deadline: float):
        self.kind = kind
        self.text = text
        self.decode = decode
        self.wait_deadline = wait_deadline  # time.monotonic() by which a worker must have taken it
        self.future: Future = Future()
        self._lock = threading.Lock()
        self._state = "queued"  # -> running | cancelled
        self._cancel = threading.Event()

    @property
    def waiting(self) -> bool:
        """Still queued for a worker (not taken, not cancelled)."""
        return self._state == "queued"

    def cancel(self) -> None:
        """Nobody wants the result: drop it from the queue, or have its worker killed."""
        with self._lock:
            if self._state == "queued":
                self._state = "cancelled"
                self._fail(CompileAbandoned("nobody waits for this grammar any more"))
            elif self._state == "running":
                self._cancel.set()

    def _take(self) -> bool:
        """queued -> running, for the slot that dequeued it; False if it was cancelled."""
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "running"
            return True

    def _expire(self, error: CompileError) -> bool:
        with self._lock:
            if self._state != "queued":
                return False
            self._state = "cancelled"
            self._fail(error)
            return True

    def _fail(self, error: CompileError) -> None:
        if not self.future.done():
            self.future.set_exception(error)


@dataclass
class PoolStats:
    """Counters and the current picture, for /metrics and tests."""

    worker_pids: list[int] = field(default_factory=list)
    busy: int = 0
    queued: int = 0
    compiled: int = 0
    spec_errors: int = 0
    timeouts: int = 0
    abandoned: int = 0
    busy_refusals: int = 0
    worker_failures: int = 0
    worker_starts: int = 0


class _Worker:
    """One live worker process and our end of its pipe."""

    def __init__(self, mp_ctx: Any, tokenizer_info_json: str):
        from tokenloom.structured.compile_worker import worker_main

        self.conn, child = mp_ctx.Pipe(duplex=True)
        lifeline, self._lifeline = mp_ctx.Pipe(duplex=False)  # (read end, write end): never written
        self.process = mp_ctx.Process(target=worker_main, args=(child, lifeline, tokenizer_info_json),
                                      name="tokenloom-grammar-worker", daemon=True)
        self.process.start()
        child.close()
        lifeline.close()
        if not self.conn.poll(START_TIMEOUT_SECONDS):
            self.kill()
            raise WorkerFailed("a grammar compile worker did not start")
        try:
            status, pid = self.conn.recv()
        except (EOFError, OSError):
            self.kill()
            raise WorkerFailed("a grammar compile worker died while starting") from None
        self.pid: int = pid

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(10)
        self.conn.close()
        self._lifeline.close()


class CompilePool:
    """`workers` compile processes for one tokenizer; see the module docstring."""

    def __init__(self, tokenizer_info_json: Callable[[], str], *, workers: int, compile_seconds: float,
                 wait_seconds: float, max_queued: int = 64, start_method: str = "forkserver"):
        if workers < 1:
            raise ValueError(f"a compile pool needs at least one worker, got {workers}")
        self.workers = workers
        self.compile_seconds = compile_seconds
        self.wait_seconds = wait_seconds
        self.max_queued = max_queued
        self._tokenizer_info_json = tokenizer_info_json
        self._info_json: str | None = None
        if start_method not in multiprocessing.get_all_start_methods():
            start_method = "spawn"
        self._mp = multiprocessing.get_context(start_method)
        if start_method == "forkserver":  # ignored if this process's forkserver already runs
            self._mp.set_forkserver_preload(["tokenloom.structured.compile_worker"])
        self._cond = threading.Condition()
        self._queue: collections.deque[CompileJob] = collections.deque()
        self._live: dict[int, _Worker] = {}  # slot -> its worker
        self._busy = 0
        self._threads: list[threading.Thread] = []
        self._closed = False
        # The first worker's start (which starts the forkserver, which imports xgrammar and with
        # it torch) takes seconds; queued jobs' waits start counting once a worker is ready.
        self._warm = False
        self.stats = PoolStats()

    # -- the caller's side --------------------------------------------------------------

    def submit(self, kind: str, text: str, decode: Callable[[str], Any]) -> CompileJob:
        """Queue one spec; the job's future gets the decoded grammar or a CompileError."""
        job = CompileJob(kind, text, decode, time.monotonic() + self.wait_seconds)
        with self._cond:
            if self._closed:
                job._expire(CompileAbandoned("the server is shutting down"))
                return job
            if not self._threads:
                self._threads = [threading.Thread(target=self._slot, args=(i,), daemon=True,
                                                  name=f"grammar-compile-{i}") for i in range(self.workers)]
                for t in self._threads:
                    t.start()
            if len(self._queue) >= self.max_queued:
                self.stats.busy_refusals += 1
                job._expire(CompilersBusy(f"{len(self._queue)} grammars already wait to be compiled; retry later"))
                return job
            self._queue.append(job)
            self._cond.notify()
        return job

    def snapshot(self) -> PoolStats:
        with self._cond:
            return dataclasses.replace(self.stats, worker_pids=sorted(w.pid for w in self._live.values()),
                                       busy=self._busy, queued=sum(1 for j in self._queue if j.waiting))

    def close(self) -> None:
        """Kill every worker and fail what waits; the slots' threads end."""
        with self._cond:
            self._closed = True
            waiting, self._queue = list(self._queue), collections.deque()
            live = list(self._live.values())
            self._cond.notify_all()
        for job in waiting:
            job._expire(CompileAbandoned("the server is shutting down"))
        for w in live:
            w.kill()
        for t in self._threads:
            t.join(15)

    # -- the slots ----------------------------------------------------------------------

    def _next_job(self) -> CompileJob | None:
        with self._cond:
            while True:
                if self._closed:
                    return None
                self._expire_waiting_locked()
                while self._queue:
                    job = self._queue.popleft()
                    if job._take():
                        self._busy += 1
                        return job
                self._cond.wait(1.0)

    def _expire_waiting_locked(self) -> None:
        if not self._warm:
            return
        now = time.monotonic()
        while self._queue and self._queue[0].wait_deadline <= now:  # FIFO: deadlines in order
            job = self._queue.popleft()
            if job._expire(CompilersBusy(f"every grammar compile worker stayed busy for {self.wait_seconds:g}s "
                                         f"(--max-concurrent-grammar-compiles {self.workers}); retry later")):
                self.stats.busy_refusals += 1

    def _start_worker(self, slot: int) -> _Worker:
        if self._closed:
            raise CompileAbandoned("the server is shutting down")
        if self._info_json is None:
            self._info_json = self._tokenizer_info_json()
        w = _Worker(self._mp, self._info_json)
        with self._cond:
            self.stats.worker_starts += 1
            if self._closed:
                w.kill()
                raise CompileAbandoned("the server is shutting down")
            self._live[slot] = w
            if not self._warm:
                self._warm = True
                restart = time.monotonic() + self.wait_seconds
                for job in self._queue:
                    job.wait_deadline = max(job.wait_deadline, restart)
        return w

    def _retire(self, slot: int, w: _Worker) -> None:
        with self._cond:
            if self._live.get(slot) is w:
                del self._live[slot]
        w.kill()

    def _slot(self, slot: int) -> None:
        worker: _Worker | None = None
        try:  # start at once, not on the first job: a cold start is not charged to a job's compile time
            worker = self._start_worker(slot)
        except CompileError as e:
            if not isinstance(e, CompileAbandoned):
                logger.error("grammar compile worker: %s", e)
        while True:
            job = self._next_job()
            if job is None:
                break
            try:
                if worker is None:
                    worker = self._start_worker(slot)
                if not self._run(worker, job):
                    self._retire(slot, worker)
                    worker = None
                    worker = self._start_worker(slot)  # ready for the next job, off its clock
            except CompileError as e:
                job._fail(e)
                if not isinstance(e, CompileAbandoned):
                    logger.error("grammar compile worker: %s", e)
            except Exception as e:  # noqa: BLE001 - a slot must not die: fail the job, go on
                logger.exception("grammar compile slot %d failed", slot)
                job._fail(WorkerFailed(f"the grammar compile worker failed ({type(e).__name__})"))
            finally:
                with self._cond:
                    self._busy -= 1
        if worker is not None:
            self._retire(slot, worker)

    def _run(self, w: _Worker, job: CompileJob) -> bool:
        """Compile `job` on `w`; False if the worker was (or must be) killed."""
        try:
            w.conn.send((job.kind, job.text))
        except (OSError, ValueError):
            self._count("worker_failures")
            job._fail(WorkerFailed("the grammar compile worker was gone"))
            return False
        deadline = time.monotonic() + self.compile_seconds
        while not w.conn.poll(POLL_SECONDS):
            with self._cond:
                self._expire_waiting_locked()
            if job._cancel.is_set():
                self._count("abandoned")
                job._fail(CompileAbandoned("nobody waits for this grammar any more"))
                return False
            if time.monotonic() >= deadline:
                self._count("timeouts")
                job._fail(CompileTimeout(f"compiling it took longer than {self.compile_seconds:g}s "
                                         f"(--max-grammar-compile-seconds)"))
                return False
        try:
            status, payload = w.conn.recv()
        except (EOFError, OSError):
            self._count("worker_failures")
            job._fail(WorkerFailed("the grammar compile worker died while compiling it"))
            return False
        if status == "ok":
            job.future.set_result(job.decode(payload))
            self._count("compiled")
        elif status == "error":
            self._count("spec_errors")
            job._fail(SpecError(payload))
        else:
            self._count("worker_failures")
            logger.error("grammar compile worker: %s", payload)
            job._fail(WorkerFailed("the grammar compiler failed on it"))
        return True

    def _count(self, name: str) -> None:
        with self._cond:
            setattr(self.stats, name, getattr(self.stats, name) + 1)
