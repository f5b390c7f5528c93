"""The router's HTTP face: an OpenAI passthrough in front of several backends.

    /health    200 while any backend is in rotation, else 503 (OpenAI-shaped error)
    /metrics   the router's own series (+ every backend's, labelled engine="i", if asked)
    anything else -> one backend chosen by the policy, relayed as it comes (SSE chunk by chunk)

Retries, and the one rule they keep: a request is retried on another backend only while
nothing of its response has reached the client.  Failures that qualify: the backend cannot
be reached or drops the connection before answering, answers 5xx, or (streaming) breaks
before its first chunk.  A plain JSON answer is read whole before it is relayed, so it is
retryable until its last byte; a stream is committed once its first chunk is read.  A
stream that breaks later ends with an SSE error event -- the client has bytes already, and
resending the request elsewhere would duplicate them.  Each backend is tried at most once
per request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from typing import AsyncIterator, Awaitable, Callable

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from tokenloom.router.health import Backend, HealthChecker
from tokenloom.router.metrics import RouterMetrics, merge_expositions
from tokenloom.router.policy import Policy, prompt_key

logger = logging.getLogger("tokenloom.router")

# Headers that describe one hop, not the message: never forwarded either way.
_HOP_HEADERS = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                          "trailer", "transfer-encoding", "upgrade", "host", "content-length"})
BACKEND_HEADER = "x-tokenloom-backend"  # which backend (by index) answered: for debugging and tests


def error_json(status: int, message: str, type: str, code: str) -> JSONResponse:
    """An OpenAI-shaped error response."""
    return JSONResponse({"error": {"message": message, "type": type, "param": None, "code": code}},
                        status_code=status)


class Router:
    """Routes requests over `backends` with `policy`; counts what it does in `metrics`."""

    def __init__(self, backend_urls: list[str], policy: Policy, *, health_interval: float = 2.0,
                 connect_timeout: float = 5.0, engine_metrics: bool = False):
        if len(backend_urls) != policy.num_backends:
            raise ValueError(f"{len(backend_urls)} backends but a policy for {policy.num_backends}")
        self.backends = [Backend(i, u.rstrip("/")) for i, u in enumerate(backend_urls)]
        self.policy = policy
        self.metrics = RouterMetrics([b.url for b in self.backends])
        self.health_interval = health_interval
        self.connect_timeout = connect_timeout
        self.engine_metrics = engine_metrics
        self.client: httpx.AsyncClient | None = None
        self.checker: HealthChecker | None = None
        self._checks: set[asyncio.Task] = set()  # health checks asked out of turn (held: tasks are weak)

    # ------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        # No read timeout: a long generation is not a failure.  Keep-alive connections
        # expire before uvicorn's (5 s) so the router rarely sends on one being closed.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64, keepalive_expiry=3.0))
        self.checker = HealthChecker(self.backends, self.client, interval=self.health_interval,
                                     on_change=self._health_changed)
        for b in self.backends:
            self._health_changed(b)
        await self.checker.check_all()
        self.checker.start()

    async def stop(self) -> None:
        if self.checker is not None:
            await self.checker.stop()
        if self.client is not None:
            await self.client.aclose()

    def _health_changed(self, b: Backend) -> None:
        self.metrics.healthy.labels(backend=b.url).set(1 if b.healthy else 0)
        if not b.healthy:
            self.policy.backend_down(b.index)

    # ------------------------------------------------------------ bookkeeping
    def _begin(self, b: Backend) -> None:
        b.in_flight += 1
        self.metrics.requests.labels(backend=b.url).inc()
        self.metrics.in_flight.labels(backend=b.url).inc()

    def _end(self, b: Backend) -> None:
        b.in_flight -= 1
        self.metrics.in_flight.labels(backend=b.url).dec()

    def _failed(self, b: Backend, reason: str, *, unreachable: bool) -> None:
        """A try on `b` failed before the client saw a byte: count the retry; take `b` out of
        rotation if it could not be reached, else ask its /health now."""
        logger.warning("backend %d (%s) failed a request (%s); retrying elsewhere", b.index, b.url, reason)
        self.metrics.retries.labels(backend=b.url).inc()
        if unreachable:
            self.checker.set_health(b, False, reason)
        else:
            self.check_soon(b)

    def check_soon(self, b: Backend) -> None:
        """Ask `b`'s /health now rather than at the next round."""
        task = asyncio.get_running_loop().create_task(self.checker.check(b))
        self._checks.add(task)
        task.add_done_callback(self._checks.discard)

    @property
    def any_healthy(self) -> bool:
        return any(b.healthy for b in self.backends)

    # ------------------------------------------------------------ relaying
    async def relay(self, request: Request) -> Response:
        """Send `request` to backends chosen by the policy until one answers (see module doc)."""
        body = await request.body()
        key = None
        if body and request.method == "POST":
            with contextlib.suppress(ValueError, RecursionError):  # not JSON: the backend will say so
                key = prompt_key(json.loads(body))
        query = request.scope.get("query_string", b"").decode("latin-1")
        target = request.url.path + ("?" + query if query else "")
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_HEADERS]
        tried: set[int] = set()
        last_5xx: Response | None = None
        while candidates := [b.index for b in self.backends if b.healthy and b.index not in tried]:
            b = self.backends[self.policy.choose(key, candidates, [x.in_flight for x in self.backends])]
            tried.add(b.index)
            answer, failed_5xx = await self._try(b, request.method, target, headers, body)
            if answer is not None:
                return answer
            last_5xx = failed_5xx or last_5xx
        self.metrics.failed.inc()
        if last_5xx is not None:
            return last_5xx
        return error_json(503, "no backend is available to serve this request"
                          + (" (every healthy backend was tried)" if tried else " (none is healthy)"),
                          "service_unavailable_error", "no_backend")

    async def _try(self, b: Backend, method: str, target: str, headers: list[tuple[str, str]],
                   body: bytes) -> tuple[Response | None, Response | None]:
        """One try on `b`: (the answer, None) to relay, or (None, its 5xx answer or None) to retry."""
        self._begin(b)
        resp: httpx.Response | None = None
        handed_over = False  # a relayed stream ends the backend response itself
        try:
            req = self.client.build_request(method, b.url + target, headers=headers, content=body)
            try:
                resp = await self.client.send(req, stream=True)
                is_stream = resp.headers.get("content-type", "").startswith("text/event-stream")
                if resp.status_code >= 500 or not is_stream:
                    content = b"".join([c async for c in resp.aiter_raw()])
                else:
                    chunks = resp.aiter_raw()
                    first = await anext(chunks, b"")
            except httpx.TransportError as e:  # nothing reached the client: retry
                unreachable = resp is None and isinstance(e, (httpx.ConnectError, httpx.ConnectTimeout))
                self._failed(b, f"{type(e).__name__}: {e}", unreachable=unreachable)
                return None, None
            out_headers = {k: v for k, v in resp.headers.items() if k.lower() not in _HOP_HEADERS}
            out_headers[BACKEND_HEADER] = str(b.index)
            if resp.status_code >= 500:
                self._failed(b, f"HTTP {resp.status_code}", unreachable=False)
                return None, Response(content, status_code=resp.status_code, headers=out_headers)
            if not is_stream:
                return Response(content, status_code=resp.status_code, headers=out_headers), None
            ended = False

            async def end() -> None:
                nonlocal ended
                if not ended:
                    ended = True
                    await resp.aclose()
                    self._end(b)

            handed_over = True
            return _RelayedStream(self._stream(b, first, chunks), end, status_code=resp.status_code,
                                  headers=out_headers), None
        finally:
            if not handed_over:
                if resp is not None:
                    await resp.aclose()
                self._end(b)

    async def _stream(self, b: Backend, first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Relay a committed stream; a break now ends it with an SSE error event (no retry)."""
        try:
            if first:
                yield first
            async for chunk in chunks:
                yield chunk
        except httpx.TransportError as e:
            self.metrics.stream_errors.labels(backend=b.url).inc()
            logger.warning("backend %d (%s) broke a stream mid-way: %s", b.index, b.url, e)
            err = {"error": {"message": f"the backend serving this stream failed mid-way ({type(e).__name__})",
                             "type": "service_unavailable_error", "param": None, "code": "backend_failed"}}
            yield b"\n\ndata: " + json.dumps(err).encode() + b"\n\n"
            self.check_soon(b)

    async def backend_metrics(self) -> str:
        """Every reachable backend's /metrics, merged, each sample labelled engine="<index>"."""
        async def fetch(b: Backend) -> tuple[str, str] | None:
            try:
                r = await self.client.get(b.url + "/metrics", timeout=5.0)
            except httpx.HTTPError:
                return None
            return (str(b.index), r.text) if r.status_code == 200 else None

        got = await asyncio.gather(*(fetch(b) for b in self.backends))
        return merge_expositions([g for g in got if g is not None])


class _RelayedStream(StreamingResponse):
    """A streaming response that always runs `on_close` (end the backend response, count the
    request finished), even when the client left before the body generator ever started."""

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]], **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.on_close()


def build_router_app(router: Router) -> FastAPI:
    """The FastAPI app around `router` (started and stopped with the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        healthy = sum(b.healthy for b in router.backends)
        logger.info("routing over %d backends (%d healthy) with the %s policy",
                    len(router.backends), healthy, router.policy.name)
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="tokenloom router", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/health")
    async def health() -> Response:
        if router.any_healthy:
            return PlainTextResponse("")
        reasons = "; ".join(f"{b.url}: {b.last_error or 'unhealthy'}" for b in router.backends)
        return error_json(503, f"no backend is healthy ({reasons})", "service_unavailable_error", "no_backend")

    @app.get("/metrics")
    async def metrics() -> Response:
        body = router.metrics.render()
        if router.engine_metrics:
            body = (await router.backend_metrics()).encode() + body
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"])
    async def relay(request: Request) -> Response:
        return await router.relay(request)

    return app
