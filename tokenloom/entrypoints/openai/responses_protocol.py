"""The Responses API's wire format (POST /v1/responses) as pydantic models.

Requests are typed as tightly as the server reads them, so the OpenAPI document says exactly
what is accepted: every supported field with its shape, and OpenAI's fields this server does
not support (`background`, `conversation`, built-in tools, ...) typed so that only their
"off" value passes -- anything else is a 400 naming the field and saying it is unsupported
(`_unsupported`), before any work is done.  Unknown fields are ignored, as on the other routes.
Output models mirror the openai client's types (openai.types.responses) field for field.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from tokenloom.entrypoints.openai.errors import UNSUPPORTED
from tokenloom.entrypoints.openai.protocol import NonEmptyStr, _integral, _Request

INPUT_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TEXT_PART_TYPES = ("input_text", "output_text")
MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def _unsupported(reason: str, *, allowed: tuple[Any, ...] = (None,)):
    """A validator refusing every value of a field but `allowed`, in words (not pydantic's
    "Input should be None")."""

    def check(v: Any) -> Any:
        if not any(type(v) is type(a) and v == a for a in allowed):  # 0 is not False here
            raise PydanticCustomError(UNSUPPORTED, reason)
        return v

    return BeforeValidator(check)


class _Strict(_Request):
    """Strict types (no "true" for true, no 0.0 for false): the server takes exactly what the
    document states.  Integers still come as 5.0 too, which JSON Schema counts as an integer."""

    model_config = ConfigDict(strict=True)


PositiveCount = Annotated[int, Field(ge=1), BeforeValidator(_integral)]


# ---- request: input items ---------------------------------------------------

class InputText(_Strict):
    type: Literal["input_text", "output_text"]  # output_text: an earlier answer sent back as it came
    text: str


class MessageItem(_Strict):
    """A message (OpenAI's EasyInputMessage / message item): `developer` is taken as `system`."""

    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]


class FunctionCallItem(_Strict):
    """A call the model made earlier (sent back for a tool round trip)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: NonEmptyStr
    arguments: str


class FunctionCallOutputItem(_Strict):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputText]


class ReasoningText(_Strict):
    type: Literal["reasoning_text", "summary_text"]
    text: str


class ReasoningItemIn(_Strict):
    """An earlier reasoning item: its text goes to the chat template with the next assistant
    message, as `reasoning_content` (templates that show past thinking read it)."""

    type: Literal["reasoning"]
    summary: list[ReasoningText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None


InputItem = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItemIn]


def _check_input(v: Any) -> Any:
    """Unsupported item and part types named precisely (input[2].content[0]: 'input_image'),
    before the union's own, vaguer, errors."""
    if not isinstance(v, list):
        return v
    if not v:
        raise PydanticCustomError("too_short", "give a text or at least one item")
    for i, item in enumerate(v):
        if not isinstance(item, dict):
            continue
        kind = item.get("type") or "message"
        if kind not in INPUT_ITEM_TYPES:
            raise PydanticCustomError(UNSUPPORTED, "item {i} has type {kind}, which this server does not support "
                                      "(only message, function_call, function_call_output and reasoning)",
                                      {"i": i, "kind": repr(kind)})
        if kind == "message" and isinstance(item.get("role"), str) and item["role"] not in MESSAGE_ROLES:
            raise PydanticCustomError(UNSUPPORTED, "item {i} has role {role}: a message is from the user, the "
                                      "assistant, the system or the developer (a tool's result is a "
                                      "function_call_output item)", {"i": i, "role": repr(item["role"])})
        parts = item.get("content") if kind == "message" else item.get("output")
        for j, part in enumerate(parts if isinstance(parts, list) else []):
            ptype = part.get("type") if isinstance(part, dict) else None
            if isinstance(ptype, str) and ptype not in TEXT_PART_TYPES:
                raise PydanticCustomError(UNSUPPORTED, "item {i} has a content part of type {kind}, which this server "
                                          "does not support (only input_text and output_text)",
                                          {"i": i, "kind": repr(ptype)})
    return v


# ---- request: tools, text format ---------------------------------------------

class FunctionTool(_Strict):
    """Responses' flat function tool: {"type": "function", "name", "description", "parameters", "strict"}."""

    type: Literal["function"]
    name: NonEmptyStr
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


def _check_tools(v: Any) -> Any:
    if isinstance(v, list):
        for i, t in enumerate(v):
            kind = t.get("type") if isinstance(t, dict) else None
            if isinstance(kind, str) and kind != "function":
                raise PydanticCustomError(UNSUPPORTED, "tool {i} has type {kind}: built-in tools are not supported by "
                                          "this server (only function tools)", {"i": i, "kind": repr(kind)})
    return v


class ToolChoiceFunction(_Strict):
    type: Literal["function"]
    name: NonEmptyStr


def _check_tool_choice(v: Any) -> Any:
    if isinstance(v, dict) and isinstance(v.get("type"), str) and v["type"] != "function":
        raise PydanticCustomError(UNSUPPORTED, "tool_choice of type {kind} is not supported (\"none\", \"auto\", "
                                  "\"required\" or {\"type\": \"function\", \"name\": ...})", {"kind": repr(v["type"])})
    return v


class FormatText(_Strict):
    type: Literal["text"]


class FormatJsonObject(_Strict):
    type: Literal["json_object"]


class FormatJsonSchema(_Strict):
    model_config = ConfigDict(populate_by_name=True)
    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64)
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None


TextFormat = Annotated[Union[FormatText, FormatJsonObject, FormatJsonSchema], Field(discriminator="type")]


class TextConfig(_Strict):
    format: TextFormat | None = None
    verbosity: Annotated[None, _unsupported("verbosity is not supported by this server")] = None


class ResponsesStreamOptions(_Strict):
    include_obfuscation: bool | None = None  # accepted; nothing is obfuscated


# ---- request ------------------------------------------------------------------

class ResponsesRequest(_Strict):
    """POST /v1/responses (docs/responses.md)."""

    model: str | None = None
    input: str | Annotated[list[InputItem], Field(min_length=1)]
    instructions: str | None = None
    max_output_tokens: PositiveCount | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceFunction | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    store: bool | None = None  # None: true, as OpenAI defaults
    previous_response_id: NonEmptyStr | None = None
    stream: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = Field(
        None, max_length=16, json_schema_extra={"propertyNames": {"maxLength": 64}})
    user: str | None = None
    include: list[Literal["reasoning.encrypted_content"]] | None = Field(
        None, description="reasoning.encrypted_content is accepted: reasoning items carry their text in the clear")
    truncation: Annotated[Literal["disabled"] | None, _unsupported(
        "only \"disabled\": a conversation longer than the context is a 400, never cut",
        allowed=(None, "disabled"))] = None
    # OpenAI's fields this server does not support: only their "off" value is accepted
    background: Annotated[Literal[False] | None, _unsupported(
        "background responses are not supported by this server", allowed=(None, False))] = None
    conversation: Annotated[None, _unsupported("conversations are not supported by this server "
                                               "(use previous_response_id)")] = None
    prompt: Annotated[None, _unsupported("prompt templates are not supported by this server")] = None
    reasoning: Annotated[None, _unsupported("reasoning settings are not supported by this server: a model's "
                                            "thinking shows as a reasoning item with --reasoning-parser")] = None
    max_tool_calls: Annotated[None, _unsupported("max_tool_calls is not supported by this server")] = None
    top_logprobs: Annotated[None, _unsupported("logprobs are not supported on /v1/responses")] = None

    _input = field_validator("input", mode="before")(lambda v: _check_input(v))
    _tools = field_validator("tools", mode="before")(lambda v: _check_tools(v))
    _tool_choice = field_validator("tool_choice", mode="before")(lambda v: _check_tool_choice(v))

    @field_validator("metadata")
    @classmethod
    def _metadata_keys(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and any(len(k) > 64 for k in v):
            raise PydanticCustomError("invalid_value", "metadata keys may have at most 64 characters")
        return v


# ---- response -------------------------------------------------------------------

class _Out(BaseModel):
    model_config = ConfigDict(extra="forbid")


class OutputText(_Out):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[Any] = Field(default_factory=list)


class OutputMessage(_Out):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed", "incomplete"]
    content: list[OutputText]


class FunctionCallOut(_Out):
    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningTextOut(_Out):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class ReasoningItemOut(_Out):
    id: str
    type: Literal["reasoning"] = "reasoning"
    summary: list[Any] = Field(default_factory=list)
    content: list[ReasoningTextOut]
    status: Literal["in_progress", "completed", "incomplete"]


OutputItem = Annotated[Union[ReasoningItemOut, OutputMessage, FunctionCallOut], Field(discriminator="type")]


class InputTokensDetails(_Out):
    cached_tokens: int = 0


class OutputTokensDetails(_Out):
    reasoning_tokens: int = 0


class ResponseUsage(_Out):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(_Out):
    reason: Literal["max_output_tokens"]


class ResponseError(_Out):
    code: str
    message: str


class ResponseObject(_Out):
    """The Response object (openai.types.responses.Response): the answer of POST and GET."""

    id: str
    object: Literal["response"] = "response"
    created_at: int = Field(default_factory=lambda: int(time.time()))
    status: Literal["completed", "incomplete", "in_progress", "failed", "cancelled"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem] = Field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: dict[str, Any] = Field(default_factory=lambda: {"effort": None, "summary": None})
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: Any = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = Field(default_factory=dict)


class ResponseDeleted(_Out):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
