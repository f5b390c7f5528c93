"""The OpenAI wire format (plus vLLM's sampling extras) as pydantic models.

Requests validate *types* here (a string where a number belongs is a 400 naming the field);
*values* (temperature < 0, top_p > 1, ...) are checked by `SamplingParams`, the one place
that knows the engine's limits, so the offline API and the server refuse the same things.
Unknown fields are ignored, as OpenAI-compatible servers commonly do, so newer clients that
send fields we do not know still work.  Every string in a request must be valid Unicode: JSON
can spell a lone UTF-16 surrogate ("\\ud800"), which no tokenizer accepts and no response can
echo, so such a body is a 400 naming the field before any handler sees it.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator
from pydantic_core import PydanticCustomError

from tokenloom.entrypoints.openai.errors import INVALID_UNICODE


def _find_lone_surrogate(value: Any, path: str) -> str | None:
    """The dotted path of the first string (or key) in `value` that is not valid Unicode."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if type(v) is str:
            if not v.isascii():
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return at or "body"
        elif type(v) is dict:
            for k, item in v.items():
                sub = f"{at}.{k}" if at else str(k)
                if type(k) is str and not k.isascii():
                    try:
                        k.encode("utf-8")
                    except UnicodeEncodeError:
                        return at or "body"
                if type(item) not in (int, float, bool) and item is not None:
                    stack.append((item, sub))
        elif type(v) is list:
            for i, item in enumerate(v):
                if type(item) not in (int, float, bool) and item is not None:  # token-id lists: nothing to check
                    stack.append((item, f"{at}.{i}"))
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)  # NaN/Infinity are not numbers a sampler can use

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        bad = _find_lone_surrogate(data, "")
        if bad is not None:
            raise PydanticCustomError(INVALID_UNICODE, "{field}: contains a lone UTF-16 surrogate (such as \\ud800), "
                                      "which is not valid Unicode text", {"field": bad})
        return data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[StrictInt] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: int | None = None
    # structured output (serving_common.structured_outputs): OpenAI's response_format, vLLM's
    # structured_outputs {json, regex, choice, grammar, json_object} and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) pass through to the chat template untouched.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # tool_calls.plan_tools: "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[StrictInt]


# ---- responses -------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """Every error this server answers, whatever the status (OpenAI's shape)."""

    error: ErrorInfo

class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class Usage(_Response):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """OpenAI's legacy completions logprobs: parallel lists, one entry per token."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, dict[str, Any]] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(_Response):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI's shape (tool_calls.ToolCall.to_openai)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class DeltaMessage(_Response):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenloom"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None]


class DetokenizeResponse(_Response):
    prompt: str


class TokenizerInfo(_Response):
    """GET /tokenizer_info: what a remote client needs to mirror the tokenizer (vLLM's endpoint;
    lm-eval-harness reads the special tokens and the chat template from it)."""

    tokenizer_class: str
    model_max_length: int  # this server's max_model_len, which may be below the tokenizer's own
    vocab_size: int  # the model's (it may pad the tokenizer's vocabulary)
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    add_bos_token: bool | None = None
    add_eos_token: bool | None = None
    chat_template: str | None = None

    @classmethod
    def of(cls, tokenizer: Any, max_model_len: int, vocab_size: int) -> "TokenizerInfo":
        def special(name: str) -> str | None:
            tok = getattr(tokenizer, name, None)
            return None if tok is None else str(tok)

        template = getattr(tokenizer, "chat_template", None)
        return cls(tokenizer_class=type(tokenizer).__name__, model_max_length=max_model_len, vocab_size=vocab_size,
                   bos_token=special("bos_token"), eos_token=special("eos_token"), pad_token=special("pad_token"),
                   unk_token=special("unk_token"), **added_special_tokens(tokenizer),
                   chat_template=template if isinstance(template, str) else None)


def added_special_tokens(tokenizer: Any) -> dict[str, bool | None]:
    """`add_bos_token` / `add_eos_token` as the tokenizer *behaves*: whether encoding with
    special tokens (what /tokenize and the engine do) puts BOS first / EOS last.  The attributes
    of that name can disagree with the tokenizer's post-processor (a Llama tokenizer.json adds
    `<s>` while transformers reports add_bos_token False), and a client mirroring the tokenizer
    must count the tokens the server will see.  None where the tokenizer has no such token."""
    out: dict[str, bool | None] = {"add_bos_token": None, "add_eos_token": None}
    try:
        plain = tokenizer.encode("a", add_special_tokens=False)
        full = tokenizer.encode("a", add_special_tokens=True)
    except Exception:  # a tokenizer that cannot encode cannot be described either
        return out
    for key, attr, at in (("add_bos_token", "bos_token_id", 0), ("add_eos_token", "eos_token_id", -1)):
        tid = getattr(tokenizer, attr, None)
        if isinstance(tid, int):
            out[key] = len(full) > len(plain) and full[at] == tid and (not plain or plain[at] != tid)
    return out
