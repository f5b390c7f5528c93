"""DashboardHub: the one pump that turns recorded steps into updates for every open page.

Cost is paid only while someone watches: the first `/dashboard/events` stream attaches the
recorder to the engine and starts the pump; the last one to leave stops the pump and
detaches it.  The pump wakes every `interval` seconds (0.25 s: at most 4 updates a second
however fast steps run), drains the recorder, aggregates, serializes once and hands the
same text to each stream; when nothing happened it stays quiet up to `idle_interval`.

A slow client keeps at most `queue_size` updates; older ones are dropped for it alone.
`close()` ends every stream (server shutdown would otherwise wait on them forever).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, AsyncIterator, Callable

from tokenloom.dashboard.aggregate import Aggregator
from tokenloom.dashboard.recorder import StepBuffer


def sse(event: str, data: dict[str, Any]) -> str:
    """One server-sent event; compact JSON (it is the bulk of the traffic)."""
    return f"event: {event}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n"


class DashboardHub:
    def __init__(self, engine: Any, config: dict[str, Any], *, interval: float = 0.25, idle_interval: float = 2.0,
                 window_s: float = 30.0, queue_size: int = 16, clock: Callable[[], float] = time.perf_counter):
        if interval <= 0:
            raise ValueError("the dashboard's update interval must be > 0")
        self.recorder = StepBuffer(engine)
        self.config = config
        self.interval = interval
        self.idle_interval = max(interval, idle_interval)
        self.window_s = window_s
        self.queue_size = queue_size
        self._clock = clock
        self._subs: set[asyncio.Queue[str | None]] = set()
        self._task: asyncio.Task | None = None
        self._agg: Aggregator | None = None
        self.closed = False
        # Its own bill, for the overhead benchmark: CPU seconds the pump spent (on the event
        # loop's thread: drain, aggregate, serialize, enqueue) and updates it sent.
        self.pump_cpu_s = 0.0
        self.updates_sent = 0

    @property
    def num_subscribers(self) -> int:
        return len(self._subs)

    @property
    def running(self) -> bool:
        return self._task is not None

    async def stream(self) -> AsyncIterator[str]:
        """The SSE text of one page's event stream: a `hello`, then `update`s until closed."""
        if self.closed:
            return
        q: asyncio.Queue[str | None] = asyncio.Queue(maxsize=self.queue_size)
        self._subs.add(q)
        if self._task is None:
            self._start()
        assert self._agg is not None
        try:
            yield sse("hello", {"config": self.config, "interval": self.interval, "rows_active": self._agg.active_rows(),
                                "steps_total": self._agg.steps_total})
            while True:
                item = await q.get()
                if item is None:
                    return
                yield item
        finally:
            self._subs.discard(q)
            if not self._subs:
                self._stop()

    def close(self) -> None:
        """End every stream and refuse new ones (server shutdown)."""
        self.closed = True
        for q in list(self._subs):
            self._offer(q, None)
        self._stop()

    # ---- internals ------------------------------------------------------
    def _start(self) -> None:
        self._agg = Aggregator(self.config, window_s=self.window_s)
        self.recorder.attach()
        self._task = asyncio.get_running_loop().create_task(self._pump(), name="tokenloom-dashboard")

    def _stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None
        self.recorder.detach()

    async def _pump(self) -> None:
        agg = self._agg
        assert agg is not None
        last_sent = self._clock()
        agg.start_clock(last_sent)
        while True:
            await asyncio.sleep(self.interval)
            cpu = time.thread_time()
            agg.ingest(self.recorder.drain())
            now = self._clock()
            if agg.has_news() or now - last_sent >= self.idle_interval:
                text = sse("update", agg.update(now))
                last_sent = now
                for q in list(self._subs):
                    self._offer(q, text)
                self.updates_sent += 1
            self.pump_cpu_s += time.thread_time() - cpu

    @staticmethod
    def _offer(q: asyncio.Queue, item: str | None) -> None:
        """Put without waiting; a full queue loses its oldest update (the close marker always fits)."""
        while True:
            try:
                q.put_nowait(item)
                return
            except asyncio.QueueFull:
                with contextlib.suppress(asyncio.QueueEmpty):
                    q.get_nowait()
