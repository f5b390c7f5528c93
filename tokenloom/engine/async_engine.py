"""AsyncLLMEngine: the synchronous step loop on a thread of its own, streams for asyncio.

The seed's decode loop is `while requests: step()`.  A server has to keep that loop turning
while it also accepts connections, parses JSON and writes SSE chunks, so:

    asyncio thread (uvicorn)                          engine thread (owns LLMEngine)
    ------------------------                          ------------------------------
    validate prompt + params (400 at once)
    add(...)  --- ("add", request) ------------>  inbox    applied between two steps
    abort(id) --- ("abort", id) --------------->  inbox    blocks go back to the pool
    async for out in stream  <-- call_soon_threadsafe --  step() -> RequestOutputs

Why a thread rather than running `step()` as an asyncio task: a step is one forward pass,
and torch releases the GIL inside its kernels, so the event loop keeps answering requests
while the model computes instead of freezing for the duration of every step.  Why exactly
one engine thread: `LLMEngine` is not thread-safe, and making it the single owner means no
lock anywhere inside the engine -- every mutation arrives through the inbox and is applied
by that one thread between steps (which is also what bounds abort latency to one step).

Streams coalesce: `RequestOutput`s are cumulative, so a stream only keeps the newest one.
A slow client therefore costs one object, never a growing backlog.

Stalled readers (`StallPolicy`, set on a stream by the SSE writer): a client that stops
reading blocks its stream's writer (the socket's buffers are full), so the outputs the
engine produces pile up unread in the stream.  Once one sequence has `max_unread_tokens`
tokens nobody took, the stream asks the engine to *pause* the request -- out of the batch,
its seat free for others, its KV blocks kept -- and to *resume* it as soon as the writer
takes the next output (the client read again).  A request paused for `timeout` seconds is
aborted: its KV blocks go back to the pool and its stream fails with status 408
(`stream_stalled`), which the client sees if it ever reads again.

Failures (see LLMEngine for what one step contains): a request the engine failed gets an
error on its stream (status 500) and the others carry on.  After `max_failed_steps`
failed steps in a row, or once the device is found broken, the engine is declared dead:
every stream in flight and every request still in the inbox fails with EngineDeadError
(503), new requests are refused, and `on_dead` is called so that the server can exit and
be restarted.  No client is ever left waiting: whatever way the thread ends, it drains
the inbox, and `add_request` after that raises instead of queueing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, NamedTuple

from tokenloom.config import EngineArgs
from tokenloom.engine.llm_engine import LLMEngine
from tokenloom.engine.metrics_observer import EngineMetrics
from tokenloom.outputs import EmbeddingRequestOutput, RequestOutput
from tokenloom.pooling_params import PoolingParams
from tokenloom.request import LoRARequest
from tokenloom.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger("tokenloom.async")


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped or crashed); nothing can be served."""


class RequestFailedError(RuntimeError):
    """The engine did not finish a request: its add was refused, a step failed (status 500),
    or the server is shutting down (status 503)."""

    def __init__(self, message: str, status: int = 500, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.code = code  # the OpenAI error code to answer with (None: decided by the status)


@dataclass(frozen=True)
class StallPolicy:
    """What happens to a stream whose client stops reading (the module docstring)."""

    max_unread_tokens: int  # pause once one sequence has this many tokens produced and not taken
    timeout: float  # abort after this many seconds paused

    def __post_init__(self) -> None:
        if self.max_unread_tokens < 1 or not self.timeout > 0:
            raise ValueError("a stall policy needs max_unread_tokens >= 1 and timeout > 0")


STALLED_CODE = "stream_stalled"


def _progress(out: RequestOutput | EmbeddingRequestOutput) -> int:
    """How far the furthest sequence of a (cumulative) output got, in tokens (an embedding: 0)."""
    if not isinstance(out.outputs, list):
        return 0
    return max((len(c.token_ids) for c in out.outputs), default=0)


class RequestStream:
    """The RequestOutputs of one request, consumed with `async for` on the event loop.

    Written to only through `loop.call_soon_threadsafe` (by the engine thread), so the
    fields below are touched by the event-loop thread alone."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 control: Callable[[tuple[str, str]], None] | None = None):
        self.request_id = request_id
        self._loop = loop
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()
        self.finished = False  # the engine delivered its final output (or an error)
        self._control = control  # sends ("pause" | "resume", request_id) to the engine thread
        self.stall: StallPolicy | None = None  # read by the engine thread too (immutable)
        self._taken = 0  # _progress of the newest output the consumer took
        self._pause_asked = False

    def watch_unread(self, policy: StallPolicy | None) -> None:
        """Pause the request while its consumer leaves `policy.max_unread_tokens` unread
        (call on the event loop; streaming responses do, where a stalled client blocks)."""
        self.stall = policy

    # -- producer side (runs on the event loop, scheduled by the engine thread) --
    def _put(self, out: RequestOutput) -> None:
        if self.finished:
            return
        self._latest = out  # cumulative: the newest output contains all older ones
        if out.finished:
            self.finished = True
        elif (self.stall is not None and not self._pause_asked and self._control is not None
              and _progress(out) - self._taken >= self.stall.max_unread_tokens):
            self._pause_asked = True
            self._control(("pause", self.request_id))
        self._ready.set()

    def _fail(self, exc: BaseException) -> None:
        if self.finished:
            return
        self._error = exc
        self.finished = True
        self._ready.set()

    # -- consumer side --
    async def next(self) -> RequestOutput | None:
        """The newest output not yet returned; None once the stream is over."""
        while True:
            if self._latest is not None:
                out, self._latest = self._latest, None
                self._taken = _progress(out)
                if self._pause_asked:  # the client reads again: so may the engine
                    self._pause_asked = False
                    if self._control is not None:
                        self._control(("resume", self.request_id))
                return out
            if self._error is not None:
                raise self._error
            if self.finished:
                return None
            self._ready.clear()
            await self._ready.wait()

    def __aiter__(self) -> AsyncIterator[RequestOutput]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[RequestOutput]:
        while (out := await self.next()) is not None:
            yield out


@dataclass
class _Add:
    request_id: str
    prompt: dict[str, Any]
    params: SamplingParams | BeamSearchParams | PoolingParams
    arrival_time: float
    priority: int
    cache_salt: str | None
    stream: RequestStream
    lora_request: LoRARequest | None = None
    lora_adapter: Any = None  # its weights, taken when the request was queued


DEFAULT_MAX_FAILED_STEPS = 3


class EngineSnapshot(NamedTuple):
    """What the engine thread publishes after each change; read whole by other threads."""

    adds_applied: int
    num_running: int
    num_waiting: int
    kv_cache_usage: float


_STOP = object()


class AsyncLLMEngine:
    """Owns an `LLMEngine` and the thread that steps it."""

    def __init__(self, engine: LLMEngine, metrics: EngineMetrics | None = None, *,
                 max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS,
                 on_dead: Callable[[str], None] | None = None):
        if max_failed_steps < 1:
            raise ValueError("max_failed_steps must be >= 1")
        self.engine = engine
        self.metrics = metrics
        if metrics is not None:
            metrics.attach(engine)
        self.max_failed_steps = max_failed_steps
        self.on_dead = on_dead  # called (on the engine thread) when the engine dies of failures
        self._inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()
        # Held while putting into the inbox and while closing it: once `_closed` is set no
        # request can slip in behind the final drain and wait forever.
        self._inbox_lock = threading.Lock()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._pause_deadlines: dict[str, float] = {}  # paused request -> when it is aborted (engine thread)
        self._adds_submitted = 0  # event-loop thread only
        self._snapshot = EngineSnapshot(0, 0, 0, 0.0)
        self._stopping = False
        self.dead_reason: str | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, with_metrics: bool = True,
                         max_failed_steps: int = DEFAULT_MAX_FAILED_STEPS) -> "AsyncLLMEngine":
        engine = LLMEngine(args)
        return cls(engine, EngineMetrics(engine.model_name) if with_metrics else None,
                   max_failed_steps=max_failed_steps)

    # ---- read-only facts (safe from any thread) -------------------------
    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and not self._stopping
                and not self._closed)

    def num_waiting(self) -> int:
        """Requests not yet scheduled, including those still in the inbox (event-loop thread)."""
        snap = self._snapshot
        return snap.num_waiting + max(0, self._adds_submitted - snap.adds_applied)

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot

    # ---- lifecycle ------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Start the engine thread; outputs are delivered to `loop` (default: the running one)."""
        if self._thread is not None:
            raise RuntimeError("the engine thread is already started")
        self._loop = loop or asyncio.get_running_loop()
        # daemon: if the process is torn down without shutdown() (a forced second Ctrl-C), a
        # thread busy in a forward pass must not keep it alive.
        self._thread = threading.Thread(target=self._run, name="tokenloom-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Abort whatever is in flight, stop the thread and wait for it (at most `timeout` s)."""
        if self._thread is None:
            return
        with self._inbox_lock:
            self._stopping = True
            if not self._closed:
                self._inbox.put(_STOP)
        self._thread.join(timeout)
        if self._thread.is_alive():
            logger.warning("engine thread still busy after %.0fs; leaving it to die with the process", timeout)
        else:
            self.engine.shutdown()

    # ---- requests (event-loop thread) -----------------------------------
    def validate(self, prompt: str | list[int],
                 params: SamplingParams | BeamSearchParams | PoolingParams) -> tuple[str | None, list[int]]:
        """Tokenize and check a prompt exactly as the engine will, without touching the engine's
        state: raises ValueError (PromptTooLongError for max_model_len) so the caller can answer
        400 before anything is queued.  Only reads the engine's constants and the tokenizer."""
        return self.engine.validate(prompt, params)

    def add_request(self, request_id: str, prompt_text: str | None, prompt_ids: list[int],
                    params: SamplingParams | BeamSearchParams | PoolingParams,
                    *, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> RequestStream:
        """Queue an already validated request (on `lora_request`'s adapter, which must be
        added to the engine: ValueError if it is not); returns its stream."""
        prompt = {"prompt": prompt_text, "prompt_token_ids": prompt_ids}
        adapter = None
        if lora_request is not None:  # its weights now: an unload before the engine thread takes it fails nothing
            held = self.engine.loras.get(lora_request.lora_int_id)
            if held is None:
                raise ValueError(f"LoRA adapter {lora_request.lora_name!r} is not loaded")
            adapter = held[1]
        with self._inbox_lock:
            if not self.is_running:
                raise EngineDeadError(self.dead_reason or "the engine is not running")
            assert self._loop is not None
            stream = RequestStream(request_id, self._loop, self._control)
            self._adds_submitted += 1
            self._inbox.put(_Add(request_id, prompt, params,
                                 time.perf_counter() if arrival_time is None else arrival_time,
                                 priority, cache_salt, stream, lora_request, adapter))
        return stream

    def abort(self, request_id: str) -> None:
        """Abort a request (no-op if it already finished); applied before the next step."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("abort", request_id))

    def _control(self, cmd: tuple[str, str]) -> None:
        """A stream's ("pause" | "resume", request_id); applied before the next step."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(cmd)

    def abort_all(self, reason: str) -> None:
        """End every in-flight request now; their streams fail with `reason` (status 503).
        Used when a graceful shutdown runs out of patience."""
        if self._thread is not None and self._thread.is_alive():
            self._inbox.put(("abort_all", reason))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       **kw: Any) -> AsyncIterator[RequestOutput]:
        """Validate, add, and yield outputs; the request is aborted if the caller stops early."""
        text, ids = self.validate(prompt, params)
        stream = self.add_request(request_id, text, ids, params, **kw)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id)

    # ---- the engine thread ----------------------------------------------
    def _deliver(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass

    def _publish(self, adds_applied: int) -> None:
        e = self.engine
        self._snapshot = EngineSnapshot(adds_applied, e.num_running, e.num_waiting, e.kv_cache_usage())

    def _run(self) -> None:
        adds_applied = 0
        try:
            while True:
                # Idle: block until something arrives.  Busy: take what is there, then step.
                cmds: list[Any] = []
                if not self.engine.has_schedulable_requests():
                    # nothing to step (idle, or every request paused): wait for a command,
                    # or until the next paused request is due to be aborted
                    try:
                        cmds.append(self._inbox.get(timeout=self._until_next_deadline()))
                    except queue.Empty:
                        pass
                while True:
                    try:
                        cmds.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                stop = False
                for cmd in cmds:
                    if cmd is _STOP:
                        stop = True
                    elif isinstance(cmd, _Add):
                        adds_applied += 1
                        self._apply_add(cmd)
                    elif cmd[0] == "abort":
                        self._apply_abort(cmd[1])
                    elif cmd[0] == "pause":
                        self._apply_pause(cmd[1])
                    elif cmd[0] == "resume":
                        self._apply_resume(cmd[1])
                    else:  # ("abort_all", reason)
                        self._abort_all(cmd[1], status=503)
                if stop:
                    self._close(lambda: RequestFailedError("the server is shutting down", 503))
                    self._publish(adds_applied)
                    return
                expired = self._abort_stalled()
                if (cmds or expired) and self.metrics is not None:
                    self.metrics.refresh_gauges()
                self._publish(adds_applied)
                if self.engine.has_schedulable_requests():
                    self._step()
                    self._publish(adds_applied)
                    fatal = self._fatal_condition()
                    if fatal is not None:
                        self._die(fatal)
                        return
        except BaseException as e:  # a bug here must not leave clients waiting forever
            logger.exception("engine thread crashed")
            self._die(f"the engine thread crashed ({type(e).__name__})")

    def _fatal_condition(self) -> str | None:
        e = self.engine
        if e.device_error is not None:
            return f"the device is broken ({e.device_error}); the engine stopped"
        if e.consecutive_failed_steps >= self.max_failed_steps:
            return f"the engine stopped after {e.consecutive_failed_steps} failed steps in a row"
        return None

    def _die(self, reason: str) -> None:
        """The engine cannot serve any more: answer everyone, refuse newcomers, tell the owner."""
        logger.error("engine dead: %s", reason)
        self.dead_reason = reason
        self._close(lambda: EngineDeadError(reason))
        with contextlib.suppress(Exception):  # best effort: the KV blocks back to the pool
            self.engine.abort_request(list(self.engine.groups))
        if self.on_dead is not None:
            try:
                self.on_dead(reason)
            except Exception:
                logger.exception("on_dead callback failed")

    def _close(self, error: Callable[[], BaseException]) -> None:
        """Fail every stream in flight and every request still in the inbox; after this,
        `add_request` raises (the inbox is closed under the same lock it puts under)."""
        with self._inbox_lock:
            self._closed = True
        for rid, stream in list(self._streams.items()):
            with contextlib.suppress(Exception):
                self._apply_abort(rid)
            self._deliver(stream._fail, error())
        self._streams.clear()
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._deliver(cmd.stream._fail, error())

    def _apply_add(self, cmd: _Add) -> None:
        try:
            self.engine.add_request(cmd.request_id, cmd.prompt, cmd.params, arrival_time=cmd.arrival_time,
                                    priority=cmd.priority, cache_salt=cmd.cache_salt,
                                    lora_request=cmd.lora_request, lora_adapter=cmd.lora_adapter)
        except Exception as e:  # validated already, so a bug or a duplicate id: fail this request only
            if not isinstance(e, ValueError):
                logger.exception("add_request(%s) failed", cmd.request_id)
            with contextlib.suppress(Exception):
                self.engine.abort_request(cmd.request_id)  # in case it got half-way in
            self._deliver(cmd.stream._fail, RequestFailedError(f"the engine refused the request: {e}"))
            return
        self._streams[cmd.request_id] = cmd.stream

    def _apply_pause(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or stream.stall is None or request_id in self._pause_deadlines:
            return  # finished meanwhile (its final output is on its way), or paused already
        if self.engine.pause_request(request_id):
            self._pause_deadlines[request_id] = time.monotonic() + stream.stall.timeout
            if self.metrics is not None:
                self.metrics.observe_pause(request_id, self._num_samples(request_id))

    def _apply_resume(self, request_id: str) -> None:
        if self._pause_deadlines.pop(request_id, None) is not None:
            self.engine.resume_request(request_id)

    def _until_next_deadline(self) -> float | None:
        """Seconds until the next paused request is due to be aborted; None: none is paused."""
        if not self._pause_deadlines:
            return None
        return max(0.0, min(self._pause_deadlines.values()) - time.monotonic())

    def _abort_stalled(self) -> int:
        """Abort the requests paused for longer than their stall timeout: KV blocks back to
        the pool, the stream fails with 408 (the client reads it if it ever reads again)."""
        now = time.monotonic()
        due = [rid for rid, deadline in self._pause_deadlines.items() if deadline <= now]
        for rid in due:
            stream = self._streams.get(rid)
            timeout = stream.stall.timeout if stream is not None and stream.stall is not None else 0.0
            logger.warning("request %s: its client read nothing for %.0fs while it was paused; aborted", rid, timeout)
            self._apply_abort(rid)
            if self.metrics is not None:
                self.metrics.observe_stalled_abort()
            if stream is not None:
                self._deliver(stream._fail, RequestFailedError(
                    f"the stream was aborted: its client read nothing for {timeout:g}s "
                    f"(--stalled-stream-timeout)", 408, STALLED_CODE))
        return len(due)

    def _num_samples(self, request_id: str) -> int:
        group = self.engine.groups.get(request_id)
        return group.params.n if group is not None else 1

    def _apply_abort(self, request_id: str) -> None:
        self._pause_deadlines.pop(request_id, None)
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return  # finished already, or never added
        group = self.engine.groups.get(request_id)
        n = group.params.n if group is not None else 1
        self.engine.abort_request(request_id)
        if self.metrics is not None:
            self.metrics.observe_abort(request_id, n)

    def _abort_all(self, reason: str, status: int = 500) -> None:
        for rid, stream in list(self._streams.items()):
            self._apply_abort(rid)
            self._deliver(stream._fail, RequestFailedError(reason, status))

    def _step(self) -> None:
        try:
            outs = self.engine.step()
        except Exception as e:
            # The engine contains request and forward failures itself; an exception here is
            # a bug in its own bookkeeping, so nothing in flight can be trusted: fail it all
            # (blocks freed) and count the step as failed.
            logger.exception("engine step raised; failing %d in-flight request(s)", len(self._streams))
            self.engine.consecutive_failed_steps += 1
            self._abort_all(f"the engine failed while running this request ({type(e).__name__})")
            return
        if not outs:
            # Unfinished requests but nothing schedulable (should not happen): don't spin hot.
            time.sleep(0.001)
            return
        for out in outs:
            if self.metrics is not None:
                try:
                    self.metrics.observe_output(out)
                except Exception:
                    logger.exception("metrics failed on the output of %s; the request is unaffected", out.request_id)
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
                self._pause_deadlines.pop(out.request_id, None)
            if out.error is not None:
                self._deliver(stream._fail, RequestFailedError(out.error, 500))
            else:
                self._deliver(stream._put, out)
