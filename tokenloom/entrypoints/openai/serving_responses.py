"""POST /v1/responses (and GET / DELETE /v1/responses/{id}): OpenAI's Responses API.

The request becomes a chat request (responses_input.py) and takes the chat path's own
admission, template, grammar and engine streams (serving_chat); only the answer's shape is
this module's.  A finished choice is split as chat splits it -- thinking (`--reasoning-parser`),
answer text, tool calls (`serving_chat._answer`) -- and becomes output items:

    reasoning      {type: reasoning, content: [{type: reasoning_text}]}     with --reasoning-parser
    message        {type: message, content: [{type: output_text}]}          the answer's text
    function_call  {type: function_call, call_id, name, arguments}          one per call

`status` is "completed", or "incomplete" (`incomplete_details.reason` "max_output_tokens")
when the token limit cut the answer.  Streaming sends OpenAI's typed events, each with its
`sequence_number`: response.created, response.in_progress, then per item
output_item.added, content_part.added, the deltas (reasoning_text / output_text /
function_call_arguments), their .done events, output_item.done, and last response.completed
(or response.incomplete); an error after the stream began is an `error` event followed by
response.failed.  A stored response (`store`, the default) keeps its conversation for
`previous_response_id` (responses_store.py).
"""

from __future__ import annotations

import contextlib
import itertools
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from tokenloom.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream, StallPolicy
from tokenloom.entrypoints.openai.errors import OpenAIError
from tokenloom.entrypoints.openai.openapi_doc import GENERATION_ERRORS, error_responses, generation_ok
from tokenloom.entrypoints.openai.protocol import ErrorResponse
from tokenloom.entrypoints.openai.responses_input import input_messages, rename_error, to_chat_request
from tokenloom.entrypoints.openai.responses_protocol import (FunctionCallOut, IncompleteDetails, InputTokensDetails,
                                                            OutputMessage, OutputText, OutputTokensDetails,
                                                            ReasoningItemOut, ReasoningTextOut, ResponseDeleted,
                                                            ResponseError, ResponseObject, ResponsesRequest,
                                                            ResponseUsage)
from tokenloom.entrypoints.openai.responses_store import ResponseStore
from tokenloom.entrypoints.openai.serving_chat import _answer, _prepare, _Prepared
from tokenloom.entrypoints.openai.serving_common import (ServingContext, SSEResponse, abort_all, collect_final, dumps,
                                                         engine_failure, merge_streams)
from tokenloom.entrypoints.openai.tool_calls import ToolCall, constrained_calls
from tokenloom.entrypoints.openai.tool_parsers import get_parser
from tokenloom.outputs import RequestOutput


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def not_found(response_id: str) -> OpenAIError:
    return OpenAIError(404, f"Response with id '{response_id}' not found.", param="response_id", code="not_found")


@dataclass
class _Answer:
    """A finished (or, while streaming, partial) answer in Responses' terms."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


@dataclass
class _Ids:
    """The output items' ids, fixed once: streamed events and the final object agree."""

    reasoning: str = field(default_factory=lambda: _id("rs"))
    message: str = field(default_factory=lambda: _id("msg"))
    calls: dict[str, str] = field(default_factory=dict)  # call_id -> item id

    def call(self, call_id: str) -> str:
        return self.calls.setdefault(call_id, _id("fc"))


def _finish(p: _Prepared, c: Any) -> _Answer:
    """A finished choice's answer; a forced call the limit cut off raises (as on chat)."""
    reasoning, text = p.split(c.text)
    try:
        content, tool_calls, reason = _answer(p, text, c.finish_reason, len(c.token_ids))
    except OpenAIError as e:
        raise rename_error(e) from None
    calls = [ToolCall(tc["function"]["name"], tc["function"]["arguments"], tc["id"]) for tc in tool_calls or []]
    if reasoning is not None and not content and not calls:
        content = None  # cut off while thinking: there is no answer
    return _Answer(reasoning, content, calls, reason)


def _items(ans: _Answer, ids: _Ids, status: str) -> list[Any]:
    status = "completed" if status == "completed" else "incomplete"  # an item's status
    items: list[Any] = []
    if ans.reasoning is not None:
        items.append(ReasoningItemOut(id=ids.reasoning, content=[ReasoningTextOut(text=ans.reasoning)],
                                      status="completed" if ans.content is not None or ans.calls else status))
    if ans.content is not None and (ans.content or not ans.calls):
        items.append(OutputMessage(id=ids.message, status=status, content=[OutputText(text=ans.content)]))
    items.extend(FunctionCallOut(id=ids.call(c.id), call_id=c.id, name=c.name, arguments=c.arguments,
                                 status="completed") for c in ans.calls)
    return items


def _usage(p: _Prepared, out: RequestOutput) -> ResponseUsage:
    c = out.outputs[0]
    prompt, completion = len(out.prompt_token_ids), len(c.token_ids)
    reasoning = p.reasoning.reasoning_tokens(list(c.token_ids), p.inside) if p.reasoning is not None else 0
    return ResponseUsage(input_tokens=prompt, input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
                         output_tokens=completion, output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                         total_tokens=prompt + completion)


def _status(finish_reason: str | None) -> str:
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


def _echo(req: ResponsesRequest, rid: str, model: str) -> ResponseObject:
    """The response object before any output: the request's settings as OpenAI echoes them."""
    fmt = req.text.format if req.text is not None and req.text.format is not None else None
    return ResponseObject(
        id=rid, status="in_progress", instructions=req.instructions, max_output_tokens=req.max_output_tokens,
        model=model, parallel_tool_calls=req.parallel_tool_calls is not False,
        previous_response_id=req.previous_response_id, store=req.store is not False, temperature=req.temperature,
        text={"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
        tool_choice=(req.tool_choice if isinstance(req.tool_choice, str) else req.tool_choice.model_dump())
        if req.tool_choice is not None else "auto",
        tools=[t.model_dump(exclude_none=True) for t in req.tools or []], top_p=req.top_p, user=req.user,
        metadata=req.metadata or {})


def _history(messages: list[dict[str, Any]], ans: _Answer) -> list[dict[str, Any]]:
    """The conversation after this response, as chat messages (what a follow-up continues)."""
    reply: dict[str, Any] = {"role": "assistant", "content": ans.content or ""}
    if ans.calls:
        reply["tool_calls"] = [c.to_openai() for c in ans.calls]
    return [*messages, reply]


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
        base = _echo(req, _id("resp"), p.model)
        if req.stream:
            events = _Events(self, req, p, streams, base, messages)
            return SSEResponse(_framed(ctx, streams, events.run()), on_close=lambda: abort_all(ctx, streams))
        finals = await collect_final(ctx, streams, raw)
        if finals is None:
            return JSONResponse({}, status_code=499)
        out = finals[0]
        ans = _finish(p, out.outputs[0])
        resp = self.complete(req, base, ans, _Ids(), _usage(p, out), messages)
        return Response(resp.model_dump_json(), media_type="application/json")

    def complete(self, req: ResponsesRequest, base: ResponseObject, ans: _Answer, ids: _Ids, usage: ResponseUsage,
                 messages: list[dict[str, Any]]) -> ResponseObject:
        """The final response object; stored unless `store` is false."""
        status = _status(ans.finish_reason)
        resp = base.model_copy(update={
            "status": status, "output": _items(ans, ids, status), "usage": usage,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None})
        if req.store is not False:
            self.store.put(resp, _history(messages, ans))
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


async def _framed(ctx: ServingContext, streams: list[RequestStream], events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The event stream, with the stalled-reader policy the other streams have (serving_common.sse_body)
    and the requests aborted however it ends.  No `[DONE]`: Responses streams end with their last event."""
    limits = ctx.limits
    if limits.max_unread_stream_tokens > 0:
        policy = StallPolicy(limits.max_unread_stream_tokens, limits.stalled_stream_timeout)
        for s in streams:
            s.watch_unread(policy)
    try:
        async with contextlib.aclosing(events):
            async for e in events:
                yield e
    finally:
        abort_all(ctx, streams)


class _Events:
    """One streamed response: engine outputs in, typed SSE events out."""

    def __init__(self, service: ResponsesService, req: ResponsesRequest, p: _Prepared, streams: list[RequestStream],
                 base: ResponseObject, messages: list[dict[str, Any]]):
        self.service, self.req, self.p, self.streams, self.base, self.messages = service, req, p, streams, base, messages
        self.seq = itertools.count()
        self.ids = _Ids()
        self.items = 0  # output items opened so far: the next one's output_index
        self.reasoning_at: int | None = None  # output_index of the open reasoning item
        self.message_at: int | None = None
        self.reasoning_sent = self.text_sent = 0
        self.streamed = ""  # the message text sent so far
        self.calls_sent: list[ToolCall] = []

    def event(self, kind: str, **fields: Any) -> str:
        body = {"type": kind, "sequence_number": next(self.seq), **fields}
        return f"event: {kind}\ndata: {dumps(body)}\n\n"

    def lifecycle(self, kind: str, resp: ResponseObject) -> str:
        return self.event(kind, response=resp.model_dump(mode="json"))

    # -- items -------------------------------------------------------------------------
    def open_reasoning(self) -> list[str]:
        self.reasoning_at, self.items = self.items, self.items + 1
        item = ReasoningItemOut(id=self.ids.reasoning, content=[], status="in_progress").model_dump(mode="json")
        return [self.event("response.output_item.added", output_index=self.reasoning_at, item=item),
                self.event("response.content_part.added", item_id=self.ids.reasoning, output_index=self.reasoning_at,
                           content_index=0, part={"type": "reasoning_text", "text": ""})]

    def close_reasoning(self, text: str, status: str = "completed") -> list[str]:
        at, rid = self.reasoning_at, self.ids.reasoning
        self.reasoning_at = None
        item = ReasoningItemOut(id=rid, content=[ReasoningTextOut(text=text)], status=status).model_dump(mode="json")
        return [self.event("response.reasoning_text.done", item_id=rid, output_index=at, content_index=0, text=text),
                self.event("response.content_part.done", item_id=rid, output_index=at, content_index=0,
                           part={"type": "reasoning_text", "text": text}),
                self.event("response.output_item.done", output_index=at, item=item)]

    def open_message(self) -> list[str]:
        self.message_at, self.items = self.items, self.items + 1
        item = OutputMessage(id=self.ids.message, status="in_progress", content=[]).model_dump(mode="json")
        return [self.event("response.output_item.added", output_index=self.message_at, item=item),
                self.event("response.content_part.added", item_id=self.ids.message, output_index=self.message_at,
                           content_index=0, part=OutputText(text="").model_dump(mode="json"))]

    def close_message(self, text: str, status: str) -> list[str]:
        at, mid = self.message_at, self.ids.message
        self.message_at = None
        status = "completed" if status == "completed" else "incomplete"
        part = OutputText(text=text).model_dump(mode="json")
        item = OutputMessage(id=mid, status=status, content=[OutputText(text=text)]).model_dump(mode="json")
        return [self.event("response.output_text.done", item_id=mid, output_index=at, content_index=0, text=text,
                           logprobs=[]),
                self.event("response.content_part.done", item_id=mid, output_index=at, content_index=0, part=part),
                self.event("response.output_item.done", output_index=at, item=item)]

    def call_events(self, call: ToolCall) -> list[str]:
        """A finished call, whole: added, its arguments as one delta, done."""
        at, self.items = self.items, self.items + 1
        fid = self.ids.call(call.id)
        self.calls_sent.append(call)
        opened = FunctionCallOut(id=fid, call_id=call.id, name=call.name, arguments="", status="in_progress")
        done = FunctionCallOut(id=fid, call_id=call.id, name=call.name, arguments=call.arguments, status="completed")
        return [self.event("response.output_item.added", output_index=at, item=opened.model_dump(mode="json")),
                self.event("response.function_call_arguments.delta", item_id=fid, output_index=at,
                           delta=call.arguments),
                self.event("response.function_call_arguments.done", item_id=fid, output_index=at,
                           arguments=call.arguments),
                self.event("response.output_item.done", output_index=at, item=done.model_dump(mode="json"))]

    # -- the stream --------------------------------------------------------------------
    def text_events(self, reasoning: str | None, text: str, visible: int) -> list[str]:
        out: list[str] = []
        if reasoning is not None and len(reasoning) > self.reasoning_sent:
            if self.reasoning_at is None:
                out += self.open_reasoning()
            out.append(self.event("response.reasoning_text.delta", item_id=self.ids.reasoning,
                                  output_index=self.reasoning_at, content_index=0,
                                  delta=reasoning[self.reasoning_sent:]))
            self.reasoning_sent = len(reasoning)
        if visible > self.text_sent:
            if self.reasoning_at is not None:
                out += self.close_reasoning(reasoning or "")
            if self.message_at is None:
                out += self.open_message()
            out.append(self.event("response.output_text.delta", item_id=self.ids.message, output_index=self.message_at,
                                  content_index=0, delta=text[self.text_sent:visible], logprobs=[]))
            self.text_sent, self.streamed = visible, text[:visible]
        return out

    async def run(self) -> AsyncIterator[str]:
        p, plan = self.p, self.p.tools
        yield self.lifecycle("response.created", self.base)
        yield self.lifecycle("response.in_progress", self.base)
        parser = get_parser(p.parser_name) if plan.mode == "auto" and p.parser_name else None
        last: RequestOutput | None = None
        try:
            async for _, out in merge_streams(self.streams):
                last, c = out, out.outputs[0]
                if c.finish_reason is not None:
                    break
                reasoning, text = p.split(c.text, final=False)
                visible = len(text)
                if plan.constraint is not None:
                    visible = 0  # a forced call: no text; each call goes out once whole
                elif parser is not None:
                    visible = max(self.text_sent, parser.safe_prefix(text))
                for e in self.text_events(reasoning, text, visible):
                    yield e
                if plan.mode == "required":
                    for call in constrained_calls(plan, text)[0][len(self.calls_sent):]:
                        for e in self.close_open(reasoning):
                            yield e
                        for e in self.call_events(call):
                            yield e
            if last is None:
                return
            for e in self.finish(last):
                yield e
        except OpenAIError as e:
            for ev in self.failed(e):
                yield ev
        except (EngineDeadError, RequestFailedError) as e:
            for ev in self.failed(engine_failure(e)):
                yield ev

    def close_open(self, reasoning: str | None) -> list[str]:
        return self.close_reasoning(reasoning or "") if self.reasoning_at is not None else []

    def finish(self, out: RequestOutput) -> list[str]:
        c = out.outputs[0]
        ans = _finish(self.p, c)  # raises the cut-off forced call's error
        status = _status(ans.finish_reason)
        sent = len(self.calls_sent)
        ans.calls = self.calls_sent + ans.calls[sent:]  # the calls already sent keep their ids
        if self.message_at is not None and not (ans.content or "").startswith(self.streamed):
            ans.content = self.streamed  # text sent before the calls began stays the message's
        events = self.text_events(ans.reasoning, ans.content or "", len(ans.content or ""))
        if self.reasoning_at is not None:
            events += self.close_reasoning(ans.reasoning or "", "completed" if ans.content is not None or status ==
                                           "completed" else "incomplete")
        if ans.content is not None and (ans.content or not ans.calls) and self.message_at is None:
            events += self.open_message()
        if self.message_at is not None:
            events += self.close_message(ans.content or "", status)
        for call in ans.calls[len(self.calls_sent):]:
            events += self.call_events(call)
        resp = self.service.complete(self.req, self.base, ans, self.ids, _usage(self.p, out), self.messages)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        events.append(self.lifecycle(kind, resp))
        return events

    def failed(self, err: OpenAIError) -> list[str]:
        failed = self.base.model_copy(update={"status": "failed",
                                              "error": ResponseError(code=err.code or "server_error",
                                                                     message=err.message)})
        return [self.event("error", code=err.code, message=err.message, param=err.param),
                self.lifecycle("response.failed", failed)]


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

