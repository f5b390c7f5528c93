"""A Responses request as the chat request the engine path already serves.

/v1/responses does not generate by itself: its request becomes a `ChatCompletionRequest`
(messages, tools, tool_choice, response_format, max_completion_tokens) and goes through the
chat path's admission, template, grammar and engine (serving_chat), so both routes decode,
constrain and parse tool calls the same way.  The mapping:

    instructions                      a system message first (not carried to a follow-up)
    previous_response_id              the stored conversation it ended (responses_store.py)
    input "text"                      a user message
    {role, content}                   that message (developer -> system; input_text/output_text parts joined)
    {type: function_call}             an assistant message's tool_calls (consecutive calls share one)
    {type: function_call_output}      a tool message
    {type: reasoning}                 reasoning_content of the next assistant message
    tools [{type: function, name,..}] chat's {type: function, function: {name, ...}}
    tool_choice {type: function, name} {type: function, function: {name}}
    text.format                       response_format (text, json_object, json_schema)
    max_output_tokens                 max_completion_tokens

Errors the chat path raises name chat's fields; `rename_error` puts them in this API's words.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ValidationError

from tokenloom.entrypoints.openai.errors import OpenAIError, bad_request
from tokenloom.entrypoints.openai.protocol import ChatCompletionRequest
from tokenloom.entrypoints.openai.responses_protocol import (FormatJsonObject, FormatJsonSchema, FunctionCallItem,
                                                            FunctionCallOutputItem, InputText, MessageItem,
                                                            ReasoningItemIn, ResponsesRequest)

_RENAMED = {"messages": "input", "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens",
            "response_format": "text.format"}
_RENAMED_IN_TEXT = re.compile(r"\b(max_completion_tokens|max_tokens|response_format)\b")


def rename_error(e: OpenAIError) -> OpenAIError:
    """An error of the chat path, naming the Responses field instead of the chat one."""
    if e.param in _RENAMED:
        e.param = _RENAMED[e.param]
    e.message = _RENAMED_IN_TEXT.sub(lambda m: _RENAMED[m.group(1)], e.message)
    e.args = (e.message,)
    return e


def _text(content: str | list[InputText]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def input_messages(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as chat messages (JSON-ready dicts, as they are also stored)."""
    if isinstance(req.input, str):
        return [{"role": "user", "content": req.input}]
    messages: list[dict[str, Any]] = []
    reasoning: list[str] = []  # reasoning items wait for the assistant message they belong to
    last_calls: dict[str, Any] | None = None  # the assistant message consecutive calls join
    for item in req.input:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            msg: dict[str, Any] = {"role": role, "content": _text(item.content)}
            if role == "assistant" and reasoning:
                msg["reasoning_content"] = "".join(reasoning)
                reasoning = []
            messages.append(msg)
            last_calls = msg if role == "assistant" else None
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            if last_calls is None:
                last_calls = {"role": "assistant", "content": ""}
                if reasoning:
                    last_calls["reasoning_content"] = "".join(reasoning)
                    reasoning = []
                messages.append(last_calls)
            last_calls.setdefault("tool_calls", []).append(call)
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
            last_calls = None
        elif isinstance(item, ReasoningItemIn):
            reasoning.extend(part.text for part in (item.content or item.summary))
    return messages


def _response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if isinstance(fmt, FormatJsonObject):
        return {"type": "json_object"}
    if isinstance(fmt, FormatJsonSchema):
        return {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": fmt.strict}}
    return None


def _tool_choice(req: ResponsesRequest) -> Any:
    choice = req.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def to_chat_request(req: ResponsesRequest, history: list[dict[str, Any]],
                    new_messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request for `req`: instructions, then the stored `history`, then its input."""
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions is not None else []) \
        + history + new_messages
    if not messages:
        raise bad_request("input holds no message (reasoning items alone are no conversation)", param="input")
    tools = None
    if req.tools is not None:
        tools = [{"type": "function", "function": t.model_dump(include={"name", "description", "parameters"},
                                                                exclude_none=True)} for t in req.tools]
    body: dict[str, Any] = {
        "model": req.model, "messages": messages, "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature, "top_p": req.top_p, "tools": tools, "tool_choice": _tool_choice(req),
        "parallel_tool_calls": req.parallel_tool_calls, "response_format": _response_format(req), "user": req.user,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:  # not expected (the Responses types are the narrower ones), but a 400 if so
        first = e.errors()[0]
        field = str(first["loc"][0]) if first.get("loc") else None
        raise rename_error(bad_request(f"{field}: {first.get('msg')}", param=field)) from None
