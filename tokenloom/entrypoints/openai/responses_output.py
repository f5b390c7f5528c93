"""The Responses API's answer: a finished chat choice as output items, usage and the response object.

A choice is split as chat splits it -- thinking (`--reasoning-parser`), answer text, tool calls
(`serving_chat._answer`) -- and becomes output items in the order the model wrote them:

    reasoning      {type: reasoning, content: [{type: reasoning_text}]}     with --reasoning-parser
    message        {type: message, content: [{type: output_text}]}          the answer's text
    function_call  {type: function_call, call_id, name, arguments}          one per call

`status` is "completed", or "incomplete" (`incomplete_details.reason` "max_output_tokens") when
the token limit cut the answer.  Item ids are fixed once per response (`ItemIds`), so streamed
events and the final object agree.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenloom.entrypoints.openai.errors import OpenAIError
from tokenloom.entrypoints.openai.responses_input import rename_error
from tokenloom.entrypoints.openai.responses_protocol import (FunctionCallOut, InputTokensDetails, OutputMessage,
                                                            OutputText, OutputTokensDetails, ReasoningItemOut,
                                                            ReasoningTextOut, ResponseObject, ResponsesRequest,
                                                            ResponseUsage)
from tokenloom.entrypoints.openai.serving_chat import _answer, _Prepared
from tokenloom.entrypoints.openai.tool_calls import ToolCall
from tokenloom.outputs import CompletionOutput, RequestOutput


def prefixed_id(prefix: str) -> str:
    """An id in OpenAI's style: "resp_...", "msg_...", "rs_...", "fc_..."."""
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Answer:
    """A finished choice in Responses' terms: the thinking, the answer text, the calls."""

    reasoning: str | None
    content: str | None
    calls: list[ToolCall]
    finish_reason: str | None


@dataclass
class ItemIds:
    """The output items' ids, fixed once: streamed events and the final object agree."""

    reasoning: str = field(default_factory=lambda: prefixed_id("rs"))
    message: str = field(default_factory=lambda: prefixed_id("msg"))
    calls: dict[str, str] = field(default_factory=dict)  # call_id -> item id

    def call(self, call_id: str) -> str:
        return self.calls.setdefault(call_id, prefixed_id("fc"))


def finish_answer(p: _Prepared, c: CompletionOutput) -> Answer:
    """A finished choice's answer; a forced call the limit cut off raises (as on chat)."""
    reasoning, text = p.split(c.text)
    try:
        content, tool_calls, reason = _answer(p, text, c.finish_reason, len(c.token_ids))
    except OpenAIError as e:
        raise rename_error(e) from None
    calls = [ToolCall(tc["function"]["name"], tc["function"]["arguments"], tc["id"]) for tc in tool_calls or []]
    if reasoning is not None and not content and not calls:
        content = None  # cut off while thinking: there is no answer
    return Answer(reasoning, content, calls, reason)


def output_items(ans: Answer, ids: ItemIds, status: str) -> list[Any]:
    """The response's output: reasoning, then the message (none when the answer is only calls,
    or was never reached), then one function_call per call."""
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


def usage_of(p: _Prepared, out: RequestOutput) -> ResponseUsage:
    """Tokens in and out; the reasoning's share of the output (tags included)."""
    c = out.outputs[0]
    prompt, completion = len(out.prompt_token_ids), len(c.token_ids)
    reasoning = p.reasoning.reasoning_tokens(list(c.token_ids), p.inside) if p.reasoning is not None else 0
    return ResponseUsage(input_tokens=prompt,
                         input_tokens_details=InputTokensDetails(cached_tokens=out.num_cached_tokens),
                         output_tokens=completion,
                         output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning),
                         total_tokens=prompt + completion)


def status_of(finish_reason: str | None) -> str:
    """The response's status from the choice's finish reason."""
    return {"length": "incomplete", "abort": "cancelled"}.get(finish_reason or "", "completed")


def echo(req: ResponsesRequest, rid: str, model: str) -> ResponseObject:
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


def conversation_after(messages: list[dict[str, Any]], ans: Answer) -> list[dict[str, Any]]:
    """The conversation after this response, as chat messages (what a follow-up continues)."""
    reply: dict[str, Any] = {"role": "assistant", "content": ans.content or ""}
    if ans.calls:
        reply["tool_calls"] = [c.to_openai() for c in ans.calls]
    return [*messages, reply]
