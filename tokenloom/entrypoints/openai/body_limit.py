"""413 for request bodies over --max-request-body-bytes, before anything reads them."""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from tokenloom.entrypoints.openai.errors import error_body


class BodySizeLimitMiddleware:
    """413 for a request body larger than `max_bytes`, before the app reads any of it.

    A declared Content-Length over the limit is refused at once; a chunked body is counted
    as it arrives and refused as soon as it passes the limit.  A body within the limit is
    handed on whole (FastAPI reads the whole body anyway), and later `receive` calls go to
    the server, so a handler still hears the client disconnect."""

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def _too_large(self, scope: dict, receive: Any, send: Any) -> None:
        resp = JSONResponse(error_body(f"the request body is larger than this server accepts ({self.max_bytes} bytes; "
                                       f"--max-request-body-bytes)", "invalid_request_error", None,
                                       "request_too_large"), status_code=413, headers={"Connection": "close"})
        await resp(scope, receive, send)

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._too_large(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            msg = await receive()
            if msg["type"] != "http.request":  # the client left before sending the body
                await self.app(scope, _replay([msg], receive), send)
                return
            body = msg.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._too_large(scope, receive, send)
                return
            chunks.append(body)
            if not msg.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)


def _replay(messages: list[dict], receive: Any) -> Any:
    pending = list(messages)

    async def replay() -> dict:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
