"""The router's view of its backends: where each is, whether it is in rotation, and how
many requests it has in flight -- plus the periodic `GET /health` that keeps that view true.

A backend leaves rotation when its health check fails (no answer, or not 200) or when a
request could not even connect to it; it comes back at the first check it passes.  Between
checks the router trusts the last answer: a request that finds a backend dead is retried
elsewhere (see `app.py`), so a stale "healthy" costs a retry, never a lost request.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Callable

import httpx

logger = logging.getLogger("tokenloom.router")


@dataclass
class Backend:
    """One OpenAI-compatible server behind the router."""

    index: int
    url: str  # base URL without a trailing slash, e.g. http://10.0.0.7:8000
    healthy: bool = False  # until the first check says so
    in_flight: int = 0  # requests the router sent and has not finished relaying
    last_error: str | None = None


class HealthChecker:
    """Checks every backend's `/health` every `interval` seconds; calls `on_change(backend)`
    whenever one enters or leaves rotation."""

    def __init__(self, backends: list[Backend], client: httpx.AsyncClient, *, interval: float = 2.0,
                 timeout: float = 5.0, on_change: Callable[[Backend], None] | None = None):
        self.backends = backends
        self.client = client
        self.interval = interval
        self.timeout = timeout
        self.on_change = on_change
        self._task: asyncio.Task | None = None

    def set_health(self, b: Backend, healthy: bool, reason: str | None = None) -> None:
        """Put `b` in or out of rotation (no-op if it already is)."""
        if healthy:
            b.last_error = None
        elif reason:
            b.last_error = reason
        if b.healthy == healthy:
            return
        b.healthy = healthy
        if healthy:
            logger.info("backend %d (%s) is healthy: back in rotation", b.index, b.url)
        else:
            logger.warning("backend %d (%s) left rotation: %s", b.index, b.url, reason or "unhealthy")
        if self.on_change is not None:
            self.on_change(b)

    async def check(self, b: Backend) -> bool:
        try:
            r = await self.client.get(b.url + "/health", timeout=self.timeout)
        except httpx.HTTPError as e:
            self.set_health(b, False, f"/health: {type(e).__name__}: {e}")
            return False
        ok = r.status_code == 200
        self.set_health(b, ok, None if ok else f"/health answered {r.status_code}")
        return ok

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(b) for b in self.backends))

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.check_all()
            except Exception:  # a bug here must not stop the checks for good
                logger.exception("health check failed")

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="router-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
