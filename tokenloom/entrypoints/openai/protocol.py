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
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, StrictInt, model_validator
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


# Constrained types: the OpenAPI document carries them, so a generated client (or a schema
# fuzzer) knows what the server accepts; limits that depend on the served model or the
# server's flags (vocabulary size, max_model_len, --max-n, ...) are added to the document per
# server by openapi_doc.install_openapi.
def _integral(v: Any) -> Any:
    """1.0 is an integer in JSON Schema (and to any JSON encoder that writes floats): take it as 1."""
    return int(v) if type(v) is float and v.is_integer() else v


TokenId = Annotated[StrictInt, Field(ge=0), BeforeValidator(_integral)]  # strict: true and "5" are not ids
NonEmptyStr = Annotated[str, Field(min_length=1)]
Logprobs = Annotated[int, Field(ge=0, le=20)]
LOGIT_BIAS_KEY = r"^(0|[1-9][0-9]*)$"  # a token id in canonical decimal


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


def _add_rules(schema: dict[str, Any], *rules: dict[str, Any]) -> None:
    """Cross-field rules (JSON Schema if/then), so the document states them too."""
    schema.setdefault("allOf", []).extend(rules)


def _needs(field: str, other: str, value: Any) -> dict[str, Any]:
    """The rule "a non-null `field` only with `other` equal to `value`"."""
    return {"if": {"required": [field], "not": {"properties": {field: {"type": "null"}}}},
            "then": {"required": [other], "properties": {other: {"const": value}}}}


_STREAM_OPTIONS_RULE = _needs("stream_options", "stream", True)  # as vLLM answers
_TOP_LOGPROBS_RULE = _needs("top_logprobs", "logprobs", True)


class _SamplingFields(_Request):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(json_schema_extra=lambda schema: _add_rules(schema, _STREAM_OPTIONS_RULE))

    model: str | None = None
    n: int = Field(1, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: NonEmptyStr | list[NonEmptyStr] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # torch.Generator's range
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    # OpenAI's shape: token ids written as decimal strings, each biased by -100..100 (checked by
    # serving_common.sampling_params, so a 400 names `logit_bias` itself; the document says it)
    logit_bias: dict[str, float] | None = Field(None, json_schema_extra={
        "propertyNames": {"pattern": LOGIT_BIAS_KEY}, "additionalProperties": {"minimum": -100, "maximum": 100}})
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: off
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[TokenId] | None = None
    allowed_token_ids: list[TokenId] | None = Field(None, min_length=1)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    cache_salt: str | None = None
    prompt_logprobs: Logprobs | None = None
    # structured output (serving_common.structured_outputs): OpenAI's response_format, vLLM's
    # structured_outputs {json, regex, choice, grammar, json_object} and its older guided_* fields
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: NonEmptyStr | None = None
    guided_choice: list[NonEmptyStr] | None = Field(None, min_length=1)
    guided_grammar: NonEmptyStr | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    max_tokens: int | None = Field(16, ge=0)  # OpenAI's default for legacy completions; 0 only with echo
    echo: bool = False
    logprobs: Logprobs | None = None
    best_of: int | None = Field(None, ge=1, description="only n itself: no other best_of is supported")
    suffix: str | None = Field(None, description="not supported: only empty",
                               json_schema_extra={"maxLength": 0})  # refused by the handler, in its words
    add_special_tokens: bool = True
    # vLLM's beam search: `n` beams, the n best sequences returned (serving_completion.py)
    use_beam_search: bool = False
    length_penalty: float = Field(1.0, ge=-10, le=10, description="beam search: a finished sequence scores its "
                                  "summed logprob / (generated tokens) ** length_penalty; ignored otherwise")


class EmbeddingRequest(_Request):
    """OpenAI's /v1/embeddings body (plus vLLM's `add_special_tokens` and `priority`)."""

    model: str | None = None
    input: str | Annotated[list[TokenId], Field(min_length=1)] | Annotated[list[str], Field(min_length=1)] | \
        Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1, description="matryoshka models only: keep the first N components")
    user: str | None = None
    add_special_tokens: bool = True
    priority: int = 0


class ChatMessage(BaseModel):
    # Extra keys (tool_calls, tool_call_id, ...) pass through to the chat template untouched.
    model_config = ConfigDict(extra="allow")
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    model_config = ConfigDict(json_schema_extra=lambda schema: _add_rules(schema, _STREAM_OPTIONS_RULE,
                                                                          _TOP_LOGPROBS_RULE))
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # tool_calls.plan_tools: "none" | "auto" | "required" | {"type": "function", ...}
    parallel_tool_calls: bool | None = None
    # vLLM extras
    add_generation_prompt: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(_Request):
    """Exactly one of `prompt` (a text) or `messages` (rendered by the chat template)."""

    model_config = ConfigDict(json_schema_extra={"oneOf": [
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}, "messages": {"type": "null"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}, "prompt": {"type": "null"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    chat_template: str | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[TokenId]


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


class EmbeddingData(_Response):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # floats, or base64 of little-endian float32 (encoding_format)


class EmbeddingUsage(_Response):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(_Response):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


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
    reasoning_content: str | None = None  # vLLM's field: the thinking, with --reasoning-parser
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
    reasoning_content: str | None = None


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


class LoadLoRAAdapterRequest(_Request):
    """POST /v1/load_lora_adapter (vLLM's): serve the peft adapter at `lora_path` (a directory on
    the server) as `lora_name`.  Beyond this schema: 404 when no adapter is there
    (adapter_config.json), 400 naming lora_path when the adapter cannot run on this model (an
    unsupported LoRA variant or target, another model's shapes, a rank above --max-lora-rank),
    409 when lora_name is already served."""

    lora_name: NonEmptyStr
    lora_path: NonEmptyStr


class UnloadLoRAAdapterRequest(_Request):
    """POST /v1/unload_lora_adapter (vLLM's): stop serving the adapter `lora_name`."""

    lora_name: NonEmptyStr


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
