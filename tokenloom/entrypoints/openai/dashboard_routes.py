"""`GET /dashboard` (the page) and `GET /dashboard/events` (its server-sent events).

Guarded like the API when the server has `--api-key`: the key may come as
`Authorization: Bearer KEY`, as `?key=KEY` in the URL (the page passes it on to its event
stream), or as the cookie the page's response set from it -- an HMAC of the key, never the
key itself.  Without a valid one: 401 in OpenAI's error shape.  `--no-dashboard` leaves the
routes out (404).  Neither route is in the OpenAPI document: the event stream never ends,
and the page is not an API.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse

from tokenloom.dashboard.hub import DashboardHub
from tokenloom.dashboard.page import render_page
from tokenloom.entrypoints.openai.auth import bearer_matches
from tokenloom.entrypoints.openai.errors import error_body

COOKIE = "tokenloom_dashboard"


def cookie_value(api_key: str) -> str:
    """What the cookie holds: proof of the key, useless as the key itself."""
    return hmac.new(api_key.encode(), b"tokenloom-dashboard", hashlib.sha256).hexdigest()


def _same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())  # constant time


def key_source(request: Request, api_key: str | None) -> str | None:
    """How the request proved the key ("none needed", "query", "header", "cookie"), or None."""
    if not api_key:
        return "none needed"
    q = request.query_params.get("key")
    if q is not None and _same(q, api_key):
        return "query"
    if bearer_matches(request.headers.get("authorization", ""), api_key):
        return "header"
    c = request.cookies.get(COOKIE)
    if c is not None and _same(c, cookie_value(api_key)):
        return "cookie"
    return None


def _unauthorized() -> JSONResponse:
    return JSONResponse(error_body("invalid or missing API key (open /dashboard?key=<key>, or send "
                                   "'Authorization: Bearer <key>')", "authentication_error", None, "invalid_api_key"),
                        status_code=401, headers={"WWW-Authenticate": "Bearer"})


def engine_facts(engine: Any, model_names: list[str]) -> dict[str, Any]:
    """The static facts the page shows next to the picture (read once, at start-up)."""
    c = engine.config
    return {"model": model_names[0] if model_names else engine.model_name,
            "max_num_batched_tokens": c.scheduler.max_num_batched_tokens, "max_num_seqs": c.scheduler.max_num_seqs,
            "kv_blocks_total": c.num_kv_blocks, "block_size": c.block_size,
            "prefix_caching": bool(c.enable_prefix_caching), "device": c.device, "dtype": c.dtype}


def install_dashboard(app: FastAPI, engine: Any, model_names: list[str], api_key: str | None) -> DashboardHub:
    """Mount the two routes for `engine` (an LLMEngine); returns the hub (to close at shutdown)."""
    hub = DashboardHub(engine, engine_facts(engine, model_names))

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        how = key_source(request, api_key)
        if how is None:
            return _unauthorized()
        resp = HTMLResponse(render_page(), headers={"Cache-Control": "no-store"})
        if how == "query" and api_key:
            resp.set_cookie(COOKIE, cookie_value(api_key), httponly=True, samesite="strict", path="/dashboard")
        return resp

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(request: Request) -> Response:
        if key_source(request, api_key) is None:
            return _unauthorized()
        if hub.closed:
            return JSONResponse(error_body("the server is shutting down", "service_unavailable_error", None,
                                           "shutting_down"), status_code=503)
        return StreamingResponse(hub.stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return hub
