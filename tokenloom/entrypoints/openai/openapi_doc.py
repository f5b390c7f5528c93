"""The OpenAPI document, made to describe what the server really answers.

FastAPI's defaults describe a different server: every body route "answers 422" (ours answer
400 in OpenAI's error shape -- see errors.py), no error status is listed, and every 200 is
`application/json`, even an SSE stream or Prometheus text.  Routes declare their error
statuses with `error_responses`, generation routes their two 200 bodies with `generation_ok`,
and `install_openapi` removes the 422s and gives every error status the JSON error schema, so
a client generated from /openapi.json, or a schema fuzzer, works from the truth.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from tokenloom.entrypoints.openai.openapi_limits import ServerFacts, apply_server_facts
from tokenloom.entrypoints.openai.protocol import ErrorResponse

_WHY = {
    400: "The request is invalid; `error.param` names the field.",
    401: "The API key is missing or wrong.",
    404: "The model is not served here.",
    409: "The name is taken: the base model or another adapter is served under it.",
    413: "The request body is larger than --max-request-body-bytes.",
    429: "The waiting queue is full (--max-queued-requests); retry later.",
    500: "The server failed (details only in its log).",
    503: "The engine is not running, or the server is shutting down.",
}

GENERATION_ERRORS = (400, 404, 413, 429, 500, 503)
TOKENIZER_ERRORS = (400, 404, 413)


def describe_api_key(enabled: bool) -> tuple[int, ...]:
    """The statuses an --api-key adds to a guarded route."""
    return (401,) if enabled else ()


def error_responses(*statuses: int, why: dict[int, str] | None = None) -> dict[int | str, dict[str, Any]]:
    """The error statuses a route answers, each with its reason (`why` overrides the usual one)."""
    reasons = {**_WHY, **(why or {})}
    return {s: {"model": ErrorResponse, "description": reasons[s]} for s in sorted(set(statuses))}


LORA_LOAD_ERRORS = (400, 404, 409, 413)
LORA_UNLOAD_ERRORS = (400, 404, 413)
LORA_WHY = {400: "The request is invalid, or the adapter cannot run on this model; `error.param` names the field.",
            404: "No LoRA adapter at `lora_path` (load), or none loaded under `lora_name` (unload)."}


SSE_EVENT = {"type": "object", "description": "one server-sent event: `data` is a JSON chunk, or `[DONE]`",
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}, "id": {"type": "string"},
                            "retry": {"type": "integer"}}}


def generation_ok(model: type[BaseModel], *statuses: int) -> dict[int | str, dict[str, Any]]:
    """200 as JSON (`model`) or, with `stream: true`, as server-sent events; plus the errors."""
    ok = {"model": model,
          "description": "The whole response as JSON; with `stream: true`, server-sent events (`data: {chunk}` "
                         "lines, an error chunk if the engine fails mid-stream, then `data: [DONE]`).",
          # Before OpenAPI 3.2, an event stream's `schema` describes one event
          "content": {"text/event-stream": {"schema": SSE_EVENT}}}
    return {200: ok, **error_responses(*statuses)}


_ERROR_CONTENT = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}}


def _truthful(doc: dict[str, Any]) -> dict[str, Any]:
    """No 422 anywhere (validation failures are 400s), and every error body declared as the
    JSON error object -- also on routes whose 200 is plain text (FastAPI would give their
    errors the route's media type)."""
    for path in doc.get("paths", {}).values():
        for op in path.values():
            if not isinstance(op, dict):
                continue
            responses = op.get("responses", {})
            responses.pop("422", None)
            for status, resp in responses.items():
                if status.isdigit() and int(status) >= 400:
                    resp["content"] = _ERROR_CONTENT
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)
    return doc


def install_openapi(app: FastAPI, facts: ServerFacts | None = None) -> None:
    """Serve the corrected document (built once, on first request) at /openapi.json, with
    this server's own limits written in (`openapi_limits`) when `facts` are given."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = _truthful(get_openapi(title=app.title, version=app.version, routes=app.routes,
                                        description=app.description))
            app.openapi_schema = apply_server_facts(doc, facts) if facts is not None else doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
