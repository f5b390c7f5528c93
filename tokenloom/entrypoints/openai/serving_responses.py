"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): OpenAI's Responses API.

The request becomes a chat request (responses_input.py) and takes the chat path's own
admission, template, grammar and engine streams (`serving_chat._prepare`); only the answer's
shape is this API's: output items (responses_output.py), typed events when streaming
(responses_stream.py).  A stored response (`store`, the default) keeps its conversation for
`previous_response_id` and GET, in a bounded memory (responses_store.py).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenloom.entrypoints.openai.errors import OpenAIError
from tokenloom.entrypoints.openai.openapi_doc import GENERATION_ERRORS, error_responses, generation_ok
from tokenloom.entrypoints.openai.protocol import ErrorResponse
from tokenloom.entrypoints.openai.responses_input import input_messages, rename_error, to_chat_request
from tokenloom.entrypoints.openai.responses_output import (Answer, ItemIds, conversation_after, echo, finish_answer,
                                                           prefixed_id, output_items, status_of, usage_of)
from tokenloom.entrypoints.openai.responses_protocol import (IncompleteDetails, ResponseDeleted, ResponseObject,
                                                            ResponsesRequest, ResponseUsage)
from tokenloom.entrypoints.openai.responses_store import ResponseStore
from tokenloom.entrypoints.openai.responses_stream import ResponseEvents, framed
from tokenloom.entrypoints.openai.serving_chat import _prepare
from tokenloom.entrypoints.openai.serving_common import ServingContext, SSEResponse, abort_all, collect_final


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")

class ResponsesService:
    """The routes' work: one per server, holding the store."""

    def __init__(self, ctx: ServingContext):
        self.ctx = ctx
        self.store = ResponseStore(ctx.max_stored_responses)

    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        ctx = self.ctx
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            prev = self.store.get(req.previous_response_id)
            if prev is None:
                raise OpenAIError(400, f"Previous response with id '{req.previous_response_id}' not found.",
                                  param="previous_response_id", code="previous_response_not_found")
            history = prev.history
        messages = history + input_messages(req)
        try:
            p, streams = await _prepare(ctx, to_chat_request(req, [], messages), raw)
        except OpenAIError as e:
            raise rename_error(e) from None
        base = echo(req, prefixed_id("resp"), p.model)
        if req.stream:
            events = ResponseEvents(p, streams, base, lambda ans, ids, usage: self.complete(req, base, ans, ids, usage,
                                                                                        messages))
            return SSEResponse(framed(ctx, streams, events.run()), on_close=lambda: abort_all(ctx, streams))
        finals = await collect_final(ctx, streams, raw)
        if finals is None:
            return JSONResponse({}, status_code=499)
        out = finals[0]
        ans = finish_answer(p, out.outputs[0])
        resp = self.complete(req, base, ans, ItemIds(), usage_of(p, out), messages)
        return Response(resp.model_dump_json(), media_type="application/json")

    def complete(self, req: ResponsesRequest, base: ResponseObject, ans: Answer, ids: ItemIds, usage: ResponseUsage,
                 messages: list[dict[str, Any]]) -> ResponseObject:
        """The final response object; stored unless `store` is false."""
        status = status_of(ans.finish_reason)
        resp = base.model_copy(update={
            "status": status, "output": output_items(ans, ids, status), "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None})
        if req.store is not False:
            self.store.put(resp, conversation_after(messages, ans))
        return resp

    def retrieve(self, response_id: str) -> ResponseObject:
        item = self.store.get(response_id)
        if item is None:
            raise not_found(response_id)
        return item.response

    def delete(self, response_id: str) -> ResponseDeleted:
        if not self.store.delete(response_id):
            raise not_found(response_id)
        return ResponseDeleted(id=response_id)


_NOT_STORED = {404: {"model": ErrorResponse, "description": "No stored response has this id (never stored, "
                                                            "deleted, or dropped from the server's memory)."}}


def install_responses(app: FastAPI, ctx: ServingContext, guarded: tuple[int, ...]) -> ResponsesService:
    """Register POST /v1/responses, GET and DELETE /v1/responses/{response_id}."""
    service = ResponsesService(ctx)

    @app.post("/v1/responses", responses=generation_ok(ResponseObject, *guarded, *GENERATION_ERRORS))
    async def create_response(body: ResponsesRequest, raw: Request):
        return await service.create(body, raw)

    @app.get("/v1/responses/{response_id}", response_model=ResponseObject,
             responses={**error_responses(*guarded), **_NOT_STORED})
    async def retrieve_response(response_id: str) -> ResponseObject:
        return service.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}", response_model=ResponseDeleted,
                responses={**error_responses(*guarded), **_NOT_STORED})
    async def delete_response(response_id: str) -> ResponseDeleted:
        return service.delete(response_id)

    app.state.responses = service
    return service

