"""StepBuffer: the dashboard's only code on the engine thread.

The engine builds a `StepEvent` per step for its metrics anyway; the recorder keeps a
reference to it in a bounded deque, plus the two facts the event does not carry: how many
KV blocks hold reusable prefix-cache content, and, for requests in a prefill, when they
arrived (TTFT needs the arrival; decode entries need nothing).  No JSON, no allocation per
decode entry, no lock: `deque.append` / `popleft` are atomic, so the event loop drains
what the engine thread appends.  It is attached only while a dashboard page is open.
"""

from __future__ import annotations

import contextlib
from collections import deque
from typing import Any, NamedTuple

from tokenloom.core.events import StepEvent


class StepRecord(NamedTuple):
    """One step as the dashboard sees it."""

    event: StepEvent
    kv_blocks_cached: int  # blocks indexed by the prefix cache (in use or evictable)
    arrivals: tuple[tuple[str, float], ...]  # (request id, arrival time) of requests in a prefill


class StepBuffer:
    """A step observer that fills a bounded buffer; `drain()` empties it from another thread.
    (The benchmarks' per-step statistics are `tokenloom.measure.steps.StepRecorder`.)"""

    def __init__(self, engine: Any, capacity: int = 4096):
        self._engine = engine  # an LLMEngine: read on the engine thread only
        self._buf: deque[StepRecord] = deque(maxlen=capacity)
        self.num_recorded = 0  # steps seen since attach (engine thread writes, others read)
        self.attached = False

    def __call__(self, event: StepEvent) -> None:
        arrivals: tuple[tuple[str, float], ...] = ()
        for e in event.entries:
            if e.phase != "decode":  # a prefill: a few per request, never per decode token
                arrivals += self._arrival(e.request_id)
        pool = self._engine.kv.pool
        self._buf.append(StepRecord(event, len(pool.cached), arrivals))
        self.num_recorded += 1

    def _arrival(self, request_id: str) -> tuple[tuple[str, float], ...]:
        group = self._engine.processor.group_of(request_id)
        if group is None:
            return ()
        return ((request_id, group.arrival_time),)

    def drain(self) -> list[StepRecord]:
        """Everything recorded since the last drain, oldest first (any thread)."""
        out: list[StepRecord] = []
        buf = self._buf
        while buf:
            try:
                out.append(buf.popleft())
            except IndexError:
                break
        return out

    def attach(self) -> None:
        """Start observing.  `list.append` is atomic and the engine iterates a copy of its
        observer list, so this is safe from the event-loop thread."""
        if not self.attached:
            self._buf.clear()
            self.num_recorded = 0
            self._engine.add_observer(self)
            self.attached = True

    def detach(self) -> None:
        if self.attached:
            with contextlib.suppress(ValueError):  # the engine detaches an observer that raised
                self._engine.remove_observer(self)
            self.attached = False
            self._buf.clear()
