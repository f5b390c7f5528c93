"""A streamed response: engine outputs in, the Responses API's typed server-sent events out.

Each event is `event: <type>` + `data: {"type", "sequence_number", ...}`, numbered from 0:
response.created, response.in_progress, then per output item output_item.added,
content_part.added, its deltas (reasoning_text / output_text / function_call_arguments), their
.done events, output_item.done, and last response.completed (or response.incomplete).  Text that
may begin a tool call is held back as on chat; a call goes out whole once complete (for
`required`, as each array item closes).  An error after the stream began is an `error` event
followed by response.failed.  No `[DONE]`: the stream ends with its last event, as OpenAI's does.
"""

from __future__ import annotations

import contextlib
import itertools
from typing import Any, AsyncIterator, Callable

from tokenloom.engine.async_engine import EngineDeadError, RequestFailedError, RequestStream
from tokenloom.entrypoints.openai.errors import OpenAIError
from tokenloom.entrypoints.openai.responses_output import Answer, ItemIds, finish_answer, status_of, usage_of
from tokenloom.entrypoints.openai.responses_protocol import (FunctionCallOut, OutputMessage, OutputText,
                                                            ReasoningItemOut, ReasoningTextOut, ResponseError,
                                                            ResponseObject, ResponseUsage)
from tokenloom.entrypoints.openai.serving_chat import _Prepared
from tokenloom.entrypoints.openai.serving_common import (ServingContext, abort_all, dumps, engine_failure, merge_streams,
                                                        watch_stalls)
from tokenloom.entrypoints.openai.tool_calls import ToolCall, constrained_calls
from tokenloom.entrypoints.openai.tool_parsers import get_parser
from tokenloom.outputs import RequestOutput

# (answer, item ids, usage) -> the final response object, stored as the service stores it
Complete = Callable[[Answer, ItemIds, ResponseUsage], ResponseObject]


async def framed(ctx: ServingContext, streams: list[RequestStream], events: AsyncIterator[str]) -> AsyncIterator[str]:
    """The event stream, with the stalled-reader policy the other streams have (serving_common.sse_body)
    and the requests aborted however it ends.  No `[DONE]`: Responses streams end with their last event."""
    watch_stalls(ctx, streams)
    try:
        async with contextlib.aclosing(events):
            async for e in events:
                yield e
    finally:
        abort_all(ctx, streams)


class ResponseEvents:
    """One streamed response: engine outputs in, typed SSE events out."""

    def __init__(self, p: _Prepared, streams: list[RequestStream], base: ResponseObject, complete: Complete):
        self.p, self.streams, self.base, self.complete = p, streams, base, complete
        self.seq = itertools.count()
        self.ids = ItemIds()
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
                    continue  # the last output: `finish` below; the streams end after it
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
        ans = finish_answer(self.p, c)  # raises the cut-off forced call's error
        status = status_of(ans.finish_reason)
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
        resp = self.complete(ans, self.ids, usage_of(self.p, out))
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(status, "response.failed")
        events.append(self.lifecycle(kind, resp))
        return events

    def failed(self, err: OpenAIError) -> list[str]:
        failed = self.base.model_copy(update={"status": "failed",
                                              "error": ResponseError(code=err.code or "server_error",
                                                                     message=err.message)})
        return [self.event("error", code=err.code, message=err.message, param=err.param),
                self.lifecycle("response.failed", failed)]
