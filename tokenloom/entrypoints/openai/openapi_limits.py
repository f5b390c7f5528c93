"""The limits only a running server knows, written into its OpenAPI document.

The request models (protocol.py) carry every constraint that holds on any server: ranges of
sampling values, non-empty strings and lists, token ids >= 0.  What depends on the model and
the flags -- token ids below the vocabulary size, token lists and max_tokens below
max_model_len, `n` up to --max-n, the stop-string and logit_bias limits, whether a request
may bring its own chat template -- is added here when the document is built, so the document
a client reads from /openapi.json is exactly what this server accepts (schemathesis's
positive and negative data checks hold it to that: tests/test_fuzz.py).

What no JSON Schema can say stays a runtime rule, documented in `RUNTIME_RULES` and in the
400 it answers: the prompt's length in tokens (plus max_tokens) against max_model_len,
min_tokens <= max_tokens, max_tokens 0 only with echo, best_of equal to n, one output
constraint per request and its grammar/regex/schema compiling, a chat template rendering the
messages it is given.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

RUNTIME_RULES = (
    "Beyond this schema, a request is refused (400, `error.param` naming the field) when: the prompt's tokens "
    "(plus max_tokens) do not fit max_model_len (`context_length_exceeded`); min_tokens exceeds max_tokens; "
    "max_tokens is 0 without echo; best_of differs from n; more than one output constraint is given "
    "(response_format, structured_outputs, guided_*), or its JSON schema, regex or grammar does not compile; "
    "the chat template cannot render the messages; a string prompt has no tokens; with use_beam_search, its n "
    "beams do not fit the batch (--max-num-seqs) or the KV cache; a tool is not {\"type\": \"function\", "
    "\"function\": {\"name\", \"parameters\"}}, two tools share a name, tool_choice is given without tools or "
    "names a function not in them, or a forced call's parameters do not compile or its call does not finish "
    "within max_tokens.")

EMBEDDING_RULES = (
    "Beyond this schema, a request is refused (400, `error.param` naming the field) when an input's tokens do not "
    "fit max_model_len (`context_length_exceeded`) or a string input has no tokens.")

# use_beam_search: true takes only settings beam search honours; these must keep their defaults
BEAM_SEARCH_DEFAULTS: dict[str, Any] = {
    "echo": False, "logprobs": None, "prompt_logprobs": None, "stop": None, "stop_token_ids": None, "min_tokens": 0,
    "logit_bias": None, "allowed_token_ids": None, "presence_penalty": 0, "frequency_penalty": 0,
    "repetition_penalty": None, "response_format": None, "structured_outputs": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None,
}

RESPONSES_RUNTIME_RULES = (
    "Beyond this schema, a request is refused (400, `error.param` naming the field) when: the conversation's "
    "tokens (instructions, the stored conversation of previous_response_id, the input) plus max_output_tokens do "
    "not fit max_model_len (`context_length_exceeded`); previous_response_id names no stored response "
    "(`previous_response_not_found`); the input holds no message; tool_choice asks for a call without tools, or "
    "names a function not in tools; two tools share a name; text.format's JSON schema, or a forced call's "
    "parameters, does not compile, or both constrain the output; a forced call (tool_choice \"required\" or a "
    "named function) cannot finish within max_output_tokens.")


TEXT_PART = {"type": "object", "required": ["type", "text"],
             "properties": {"type": {"const": "text"}, "text": {"type": "string"}}}


_NULL = {"type": "null"}
_GRAMMAR_KINDS = {  # structured_outputs' members (serving_common.structured_outputs reads them)
    "json": {"type": ["object", "string"]},
    "regex": {"type": "string", "minLength": 1},
    "choice": {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
    "grammar": {"type": "string", "minLength": 1},
}
# Exactly one member set (json_object only as true); other keys are ignored.
STRUCTURED_OUTPUTS = {"type": "object", "oneOf": [
    *({"required": [k], "properties": {**{o: _NULL for o in _GRAMMAR_KINDS if o != k}, k: v,
                                       "json_object": {"enum": [None, False]}}} for k, v in _GRAMMAR_KINDS.items()),
    {"required": ["json_object"], "properties": {**{o: _NULL for o in _GRAMMAR_KINDS}, "json_object": {"const": True}}},
]}
# OpenAI's response_format: text (the default), json_object, or json_schema with its schema.
RESPONSE_FORMAT = {"type": "object", "properties": {
    "type": {"enum": ["text", "json_object", "json_schema"]},
    "json_schema": {"type": "object", "properties": {"schema": {"type": "object"}}}},
    "if": {"required": ["type"], "properties": {"type": {"const": "json_schema"}}},
    "then": {"required": ["json_schema"], "properties": {"json_schema": {"required": ["schema"]}}}}


@dataclass(frozen=True)
class ServerFacts:
    """What the document needs to know about the running server."""

    vocab_size: int
    max_model_len: int
    max_n: int
    max_stop_strings: int
    max_stop_string_chars: int
    max_prompts_per_request: int
    max_logit_bias: int
    tokenize_limit: int
    trust_request_chat_template: bool
    empty_text_has_tokens: bool  # the tokenizer adds special tokens (a BOS) even to ""
    # embeddings (--runner pooling): the vector's length, and what `dimensions` may ask
    embedding_size: int = 0
    matryoshka: bool = False  # a request may shorten the vector
    matryoshka_dimensions: tuple[int, ...] | None = None  # ...to one of these only


def decimal_range_pattern(hi: int) -> str:
    """A regex matching exactly the canonical decimals 0..hi (no sign, no leading zeros)."""
    top = str(hi)
    if len(top) == 1:
        return f"^[0-{top}]$"
    alts = ["[0-9]"] + ["[1-9]" + "[0-9]" * (d - 1) for d in range(2, len(top))]
    for i, ch in enumerate(top):  # same length: equal up to digit i, lower there, anything after
        lo = 1 if i == 0 else 0
        if int(ch) > lo:
            alts.append(top[:i] + f"[{lo}-{int(ch) - 1}]" + "[0-9]" * (len(top) - i - 1))
    alts.append(top)
    return "^(" + "|".join(alts) + ")$"


def _branches(prop: dict[str, Any], kind: str) -> Iterator[dict[str, Any]]:
    """The `kind`-typed alternatives of a property schema (pydantic writes optionals as anyOf)."""
    for s in prop.get("anyOf", [prop]):
        if s.get("type") == kind:
            yield s


def _token_list(schema: dict[str, Any], facts: ServerFacts, max_items: int) -> None:
    schema["items"]["maximum"] = facts.vocab_size - 1
    schema["maxItems"] = max_items


def _embedding_limits(schema: dict[str, Any] | None, facts: ServerFacts) -> None:
    """/v1/embeddings: token ids in the vocabulary, inputs within max_model_len (an embedding
    needs no room for a generated token) and the request's count, `dimensions` as the model allows."""
    if schema is None:
        return
    schema["description"] = EMBEDDING_RULES
    props = schema.get("properties", {})
    for s in _branches(props.get("input", {}), "string"):
        if not facts.empty_text_has_tokens:
            s["minLength"] = 1
    for s in _branches(props.get("input", {}), "array"):
        items = s["items"]
        if items.get("type") == "integer":
            _token_list(s, facts, facts.max_model_len)
        else:
            s["maxItems"] = facts.max_prompts_per_request
            if items.get("type") == "array":
                _token_list(items, facts, facts.max_model_len)
            elif not facts.empty_text_has_tokens:
                items["minLength"] = 1
    dims = props.get("dimensions")
    if dims is not None:
        if not facts.matryoshka:
            props["dimensions"] = {**_NULL, "title": "Dimensions", "default": None,
                                   "description": "refused: this model is not a matryoshka model"}
        for s in _branches(props["dimensions"], "integer"):
            if facts.matryoshka_dimensions:
                s["enum"] = list(facts.matryoshka_dimensions)
            s["maximum"] = facts.embedding_size


def apply_server_facts(doc: dict[str, Any], facts: ServerFacts) -> dict[str, Any]:
    """Write the per-server limits into the request schemas of `doc` (in place; returned)."""
    schemas = doc.get("components", {}).get("schemas", {})
    context = facts.max_model_len - 1  # a prompt or an answer leaves room for at least one more token
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        for s in _branches(props.get("seed", {}), "integer"):  # FastAPI writes bounds as floats: 2**63 - 1 ~ 2**63
            s.update(minimum=-(2**63), maximum=2**63 - 1)
        for s in _branches(props.get("n", {}), "integer"):
            s["maximum"] = facts.max_n
        for field in ("max_tokens", "max_completion_tokens"):
            for s in _branches(props.get(field, {}), "integer"):
                s["maximum"] = context
        for s in _branches(props.get("stop", {}), "string"):
            s["maxLength"] = facts.max_stop_string_chars
        for s in _branches(props.get("stop", {}), "array"):
            s["maxItems"] = facts.max_stop_strings
            s["items"]["maxLength"] = facts.max_stop_string_chars
        for field in ("stop_token_ids", "allowed_token_ids"):
            for s in _branches(props.get(field, {}), "array"):
                _token_list(s, facts, facts.vocab_size)
        bias = props.get("logit_bias", {})
        bias.pop("propertyNames", None)  # the fixed shape (protocol.py), made exact for this vocabulary:
        bias.pop("additionalProperties", None)
        for s in _branches(bias, "object"):
            s.update(propertyNames={"pattern": decimal_range_pattern(facts.vocab_size - 1)},
                     additionalProperties={"type": "number", "minimum": -100, "maximum": 100},
                     maxProperties=facts.max_logit_bias)
        for field, shape in (("structured_outputs", STRUCTURED_OUTPUTS), ("response_format", RESPONSE_FORMAT)):
            if field in props:
                props[field]["anyOf"] = [shape, _NULL]
        if name in schemas:
            schemas[name]["description"] = RUNTIME_RULES
    beam = schemas.get("CompletionRequest")
    if beam is not None and "use_beam_search" in beam.get("properties", {}):
        beam.setdefault("allOf", []).append({  # beam search takes none of the sampling-only settings
            "if": {"required": ["use_beam_search"], "properties": {"use_beam_search": {"const": True}}},
            "then": {"properties": {k: _NULL if v is None else {"const": v} for k, v in BEAM_SEARCH_DEFAULTS.items()}}})
    _embedding_limits(schemas.get("EmbeddingRequest"), facts)
    responses = schemas.get("ResponsesRequest")
    if responses is not None:
        for s in _branches(responses.get("properties", {}).get("max_output_tokens", {}), "integer"):
            s["maximum"] = context
        responses["description"] = RESPONSES_RUNTIME_RULES
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for s in _branches(prompt, "string"):
        if not facts.empty_text_has_tokens:
            s["minLength"] = 1
    for s in _branches(prompt, "array"):
        items = s["items"]
        if items.get("type") == "integer":
            _token_list(s, facts, context)
        else:
            s["maxItems"] = facts.max_prompts_per_request
            if items.get("type") == "array":
                _token_list(items, facts, context)
            elif not facts.empty_text_has_tokens:
                items["minLength"] = 1
    for s in _branches(schemas.get("ChatMessage", {}).get("properties", {}).get("content", {}), "array"):
        s["items"] = TEXT_PART  # what serving_chat reads; any other part is refused
    detok = schemas.get("DetokenizeRequest", {}).get("properties", {}).get("tokens")
    if detok is not None:
        _token_list(detok, facts, facts.tokenize_limit)
    if not facts.trust_request_chat_template:  # refused unless --trust-request-chat-template
        for name in ("ChatCompletionRequest", "TokenizeRequest"):
            props = schemas.get(name, {}).get("properties", {})
            if "chat_template" in props:
                props["chat_template"] = {"type": "null", "title": "Chat Template", "default": None,
                                          "description": "refused: this server does not run request templates "
                                                         "(--trust-request-chat-template)"}
    return doc
