"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

Every way a request can fail ends up here, so clients (the official `openai` package
included) always get the same JSON and a status that says whose fault it was:
4xx for the client's mistakes -- never a 500 -- and 5xx only for the server's own.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Sequence

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tokenloom.server")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "internal_server_error",
    503: "service_unavailable_error",
}


class OpenAIError(Exception):
    """Raise anywhere in a handler; becomes a JSON error response with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 type: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "internal_server_error")

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | int | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = "invalid_value") -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def context_length_exceeded(max_model_len: int, prompt_tokens: int | str, max_tokens: int | None, *,
                            where: str, param: str) -> OpenAIError:
    """The 400 for a prompt (plus max_tokens) beyond max_model_len, in OpenAI's words: clients
    match on them (LiteLLM maps "This model's maximum context length is" to its
    ContextWindowExceededError, which drives its context-window fallbacks).  `where`:
    "messages" (chat) or "prompt" (completions); `max_tokens` None: the prompt alone is too long
    (then `prompt_tokens` may be a bound in words, "at least N")."""
    head = f"This model's maximum context length is {max_model_len} tokens. "
    if max_tokens is None:
        msg = (head + f"However, your {where} resulted in {prompt_tokens} tokens, and the completion needs at least "
               f"one more. Please reduce the length of the {where}.")
    else:
        assert isinstance(prompt_tokens, int)
        msg = (head + f"However, you requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the {where}, "
               f"{max_tokens} in the completion). Please reduce the length of the {where} or completion.")
    return OpenAIError(400, msg, param=param, code="context_length_exceeded")


def grammar_error(e: Exception, param: str) -> OpenAIError:
    """A grammar that could not be had (structured.GrammarError: a bad schema, no xgrammar, a
    compile over its limits) as the answer to a request, naming `param`: the field the client
    sent the constraint in (`response_format`, `guided_json`, `tool_choice`, ...), in the
    `param` and at the head of the message, whatever field the compiler assumed."""
    msg, own = str(e), getattr(e, "param", None)
    if own and msg.startswith(f"{own}: "):
        msg = msg[len(own) + 2:]
    status = getattr(e, "status", 400)
    return OpenAIError(status, f"{param}: {msg}", param=param, code=getattr(e, "code", "invalid_value"),
                       headers={"Retry-After": "1"} if status == 429 else None)


def output_cut_off(param: str, num_tokens: int, *, explicit: bool) -> OpenAIError:
    """The 400 for a forced tool call (tool_choice "required" or a named function) that the
    token limit cut off before any call was complete: OpenAI's wording for an answer its
    constraint could not finish.  `param`: the limit the client sent (max_tokens or
    max_completion_tokens); `explicit`: whether it sent one (else the context ran out)."""
    if explicit:
        limit, fix = f"{param} ({num_tokens} tokens)", f"a higher {param}"
    else:
        limit, fix = f"the room left in the context ({num_tokens} tokens)", "a shorter conversation"
    return OpenAIError(400, f"Could not finish the message because max_tokens or model output limit was reached: "
                            f"{limit} ran out before a tool call was complete. Please try again with {fix}.",
                       param=param, code="length_limit_reached")


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


def sse_error(err: OpenAIError) -> str:
    """An error met after a stream started: the status is already 200, so say it in a chunk."""
    return f"data: {json.dumps(err.body())}\n\n"


INVALID_UNICODE = "invalid_unicode"  # the pydantic error type for a string that is not valid Unicode
UNSUPPORTED = "unsupported"  # the pydantic error type for a field (or value) the server does not support


def _param_of(loc: Sequence[Any]) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # pydantic names union members in the location ("prompt.str", "prompt.list[int]"): keep the field
    keep = [p for p in parts if not any(ch in p for ch in "[]") and p not in ("str", "int", "float", "bool",
                                                                                  "function-after", "json-or-python")]
    return ".".join(keep) or None


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 (pydantic) -> a 400 naming the first offending field."""
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request body")
    first = errors[0]
    if first.get("type") == INVALID_UNICODE:  # raised by protocol's check, which names the field in ctx
        ctx = first.get("ctx") or {}
        return bad_request(str(first.get("msg")), param=ctx.get("field"), code="invalid_unicode")
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return bad_request(f"the request body is not valid JSON: {ctx.get('error', first.get('msg'))}",
                           code="invalid_json")
    param = _param_of(first.get("loc", ()))
    if param is None:  # the body as a whole: missing, not an object, or not sent as JSON
        return bad_request(f"the request body must be a JSON object sent with Content-Type: application/json "
                           f"({first.get('msg')})", code="invalid_json")
    msgs = []
    seen: set[str] = set()
    for e in errors:
        p = _param_of(e.get("loc", ())) or "body"
        if p in seen:  # a union field fails once per member; one line per field is enough
            continue
        seen.add(p)
        msgs.append(f"{p}: {e.get('msg')}")
    return bad_request("; ".join(msgs), param=param,
                       code="unsupported_value" if first.get("type") == UNSUPPORTED else "invalid_value")


async def _openai_error_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, OpenAIError)
    return error_response(exc)


async def _validation_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(validation_error(exc))


async def _http_handler(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
    err = OpenAIError(exc.status_code, str(exc.detail), code=code)
    resp = error_response(err)
    if exc.headers:
        resp.headers.update(exc.headers)
    return resp


async def _unexpected_handler(request: Request, exc: Exception) -> JSONResponse:
    # The exception's text goes to the log, never to the client: it can carry paths, tensor
    # shapes or fragments of other requests.
    logger.error("internal error answering %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(OpenAIError(500, "internal server error (the details are in the server log)",
                                      code="internal_error"))


def install_error_handlers(app) -> None:
    app.add_exception_handler(OpenAIError, _openai_error_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(Exception, _unexpected_handler)
