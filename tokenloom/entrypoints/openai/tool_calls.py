"""Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`.

- `none`: the tools are left out of the prompt; the answer is plain text.
- `required` and a named function: the output is *constrained* (structured output, an xgrammar
  JSON schema) so that it is a call whatever the model is: for a named function, its
  arguments document; for `required`, a JSON array of `{"name", "arguments"}` objects, each
  naming one of the functions and carrying that function's arguments.  Any model can do
  this, tool-trained or not.
- `auto`: the model decides; its own tool-call format is parsed from the text by the
  server's `--tool-call-parser` (`hermes`: Hermes / Qwen2.5 `<tool_call>{...}</tool_call>`;
  `llama3_json`: Llama 3.1's bare `{"name": ..., "parameters": ...}`).

The answer is OpenAI's shape: `message.tool_calls` (`id` "call_...", `type` "function",
`function` {`name`, `arguments` as a JSON string}), `content` null (or the text before the
calls), `finish_reason` "tool_calls".
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenloom.entrypoints.openai.errors import bad_request
from tokenloom.sampling_params import StructuredOutputsParams

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
# A function without `parameters` takes none (OpenAI): its arguments are the empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What a request's `tools` / `tool_choice` mean for rendering, decoding and the answer.

    `mode`: "none", "auto", "required" or "named"; `template_tools`: what the chat template
    receives (None: no tools); `constraint`: the output constraint (required / named);
    `named`: the forced function's name."""

    mode: str
    template_tools: list[dict[str, Any]] | None = None
    constraint: StructuredOutputsParams | None = None
    named: str | None = None
    names: list[str] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON document, as text
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        d: dict[str, Any] = {"id": self.id, "type": "function",
                             "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:  # stream deltas carry the call's index
            d = {"index": index, **d}
        return d


def _functions(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Check `tools`' shape; each tool's `function` dict (400 naming `tools` otherwise)."""
    out, seen = [], set()
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(fn, dict):
            raise bad_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}].function.name must be a non-empty string", param="tools")
        if name in seen:
            raise bad_request(f"tools: the function name {name!r} is given twice", param="tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        out.append(fn)
    return out


def _arguments_schema(fn: dict[str, Any]) -> dict[str, Any]:
    params = fn.get("parameters")
    return params if params else _NO_PARAMETERS


def plan_tools(tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str | None,
               parallel_tool_calls: bool | None = None) -> ToolPlan:
    """Map a request's `tools` / `tool_choice` to a `ToolPlan`; a bad one is a 400 naming
    the field.  `parser`: the server's `--tool-call-parser` (needed for `auto`)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", param="tool_choice")
        return ToolPlan("none")
    fns = _functions(tools)
    names = [f["name"] for f in fns]
    template_tools = [{"type": "function", "function": f} for f in fns]
    choice = "auto" if tool_choice is None else tool_choice
    if choice == "none":
        return ToolPlan("none", names=names)
    if choice == "auto":
        if parser is None:
            raise bad_request("tool_choice \"auto\" needs the server to parse the model's tool calls: start it with "
                              f"--tool-call-parser ({'|'.join(TOOL_CALL_PARSERS)}), or send tool_choice "
                              "\"required\" or a named function", param="tool_choice")
        return ToolPlan("auto", template_tools, names=names)
    if choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"enum": [f["name"]]}, "arguments": _arguments_schema(f)},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        return ToolPlan("required", template_tools, StructuredOutputsParams(json=schema), names=names)
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request("tool_choice must be \"none\", \"auto\", \"required\" or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        if name not in names:
            raise bad_request(f"tool_choice names the function {name!r}, which is not in tools "
                              f"({', '.join(names)})", param="tool_choice")
        target = fns[names.index(name)]
        return ToolPlan("named", template_tools, StructuredOutputsParams(json=_arguments_schema(target)),
                        named=name, names=names)
    raise bad_request(f"tool_choice must be \"none\", \"auto\", \"required\" or a named function, got {choice!r}",
                      param="tool_choice")


def _dump(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False)


def constrained_calls(plan: ToolPlan, text: str) -> list[ToolCall] | None:
    """The calls in a finished constrained answer (None if it does not parse: cut short)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    if plan.mode == "named":
        return [ToolCall(plan.named or "", _dump(doc))]
    if not isinstance(doc, list):
        return None
    return [ToolCall(c["name"], _dump(c["arguments"])) for c in doc
            if isinstance(c, dict) and "name" in c and "arguments" in c]


# ---- the model's own formats (tool_choice "auto") --------------------------------------

class ToolCallParser:
    """Finds tool calls in a model's text.  `parse` -> (content before the calls or None,
    calls); `safe_prefix` -> how much of a partial text may be streamed as content, because
    no call can begin within it."""

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        raise NotImplementedError


def _call_from(obj: Any, names: list[str], args_key: str) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if names and obj["name"] not in names:
        return None
    args = obj.get(args_key, obj.get("arguments" if args_key != "arguments" else "parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except ValueError:
            return None
    return ToolCall(obj["name"], _dump(args))


class HermesParser(ToolCallParser):
    """Hermes / Qwen2.5: `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, any
    number of them, possibly after some text.  A call the model did not close (the answer
    ended first) is still read if its JSON is complete."""

    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        start = text.find(self.START)
        if start < 0:
            return text, []
        calls = []
        for m in self._BLOCK.finditer(text, start):
            try:
                call = _call_from(json.loads(m.group(1).strip()), names, "arguments")
            except ValueError:
                call = None
            if call is None:
                return text, []  # not a well-formed call: the text stays the answer
            calls.append(call)
        content = text[:start]
        return (content if content.strip() else None), calls

    def safe_prefix(self, text: str) -> int:
        at = text.find(self.START)
        if at >= 0:
            return at
        # Hold back a tail that could be the start of "<tool_call>".
        for k in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-k:]):
                return len(text) - k
        return len(text)


class Llama3JsonParser(ToolCallParser):
    """Llama 3.1's JSON tool calls: the answer *is* `{"name": ..., "parameters": {...}}`
    (several separated by `;`), optionally after `<|python_tag|>`."""

    _TAG = "<|python_tag|>"

    def parse(self, text: str, names: list[str]) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self._TAG).strip()
        if not body.startswith("{"):
            return text, []
        decoder, calls, i = json.JSONDecoder(), [], 0
        while i < len(body):
            try:
                obj, end = decoder.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call_from(obj, names, "parameters")
            if call is None:
                return text, []
            calls.append(call)
            i = end
            while i < len(body) and body[i] in " \t\r\n;":
                i += 1
        return None, calls

    def safe_prefix(self, text: str) -> int:
        body = text.lstrip()
        if not body or body.startswith("{") or self._TAG.startswith(body[:len(self._TAG)]) \
                or body.startswith(self._TAG):
            return 0  # might be a call: hold it until the answer is complete
        return len(text)


def get_parser(name: str) -> ToolCallParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    raise ValueError(f"unknown tool call parser {name!r} (choose from {', '.join(TOOL_CALL_PARSERS)})")
