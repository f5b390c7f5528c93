"""Tool calling on /v1/chat/completions: OpenAI's `tools` and `tool_choice`.

- `none`: the tools are left out of the prompt; the answer is plain text.
- `required` and a named function: the output is *constrained* (structured output, an xgrammar
  JSON schema) so that it is a call whatever the model is: for a named function, its
  arguments document; for `required`, a JSON array of `{"name", "arguments"}` objects, each
  naming one of the functions and carrying that function's arguments -- exactly one with
  `parallel_tool_calls: false`, otherwise 1 to `MAX_PARALLEL_CALLS`, the array closable after
  each call.  Any model can do this, tool-trained or not.
- `auto` (the default when tools are given): the model decides; its own tool-call format is
  parsed from the text (tool_parsers.py: `--tool-call-parser`, or the chat template's family).
  With no parser for this model, `auto` answers in text: the tools are left out of the prompt,
  as for `none`, so the model is never shown tools in a format nobody would read back.

The answer is OpenAI's shape: `message.tool_calls` (`id` "call_...", `type` "function",
`function` {`name`, `arguments` as a JSON string}), `content` null (or the text before the
calls), `finish_reason` "tool_calls".
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from tokenloom.entrypoints.openai.errors import bad_request
from tokenloom.sampling_params import StructuredOutputsParams

# The most calls one `required` answer may hold when parallel calls are allowed.  OpenAI sets
# no documented number; a bound keeps a model that never closes the array (a weak one at a
# high temperature) from spending max_tokens on calls it then cannot finish.
MAX_PARALLEL_CALLS = 8
# A function without `parameters` takes none (OpenAI): its arguments are the empty object.
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


@dataclass
class ToolPlan:
    """What a request's `tools` / `tool_choice` mean for rendering, decoding and the answer.

    `mode`: "none", "auto", "required" or "named" ("none" also for `auto` without a parser:
    text); `template_tools`: what the chat template receives (None: no tools);
    `constraint`: the output constraint (required / named); `named`: the forced function's name."""

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
    the field.  `parser`: the tool-call parser for this model (`auto` answers in text without one)."""
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
        if parser is None:  # nobody could read this model's calls: the model answers in text
            return ToolPlan("none", names=names)
        return ToolPlan("auto", template_tools, names=names)
    if choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"enum": [f["name"]]}, "arguments": _arguments_schema(f)},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in fns]
        schema: dict[str, Any] = {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
                                  "minItems": 1, "maxItems": 1 if parallel_tool_calls is False else MAX_PARALLEL_CALLS}
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


def dump_json(obj: Any) -> str:
    """A call's arguments as OpenAI sends them: JSON text."""
    return json.dumps(obj, ensure_ascii=False)


def constrained_calls(plan: ToolPlan, text: str) -> tuple[list[ToolCall], bool]:
    """The calls in a constrained answer, and whether the document is complete.

    A complete document gives all its calls.  One cut short (by max_tokens) gives the calls
    that were finished before the cut: for `required`, each array item that parses whole;
    for a named function, none (its only call is the unfinished one)."""
    try:
        doc = json.loads(text)
    except ValueError:
        return (_finished_items(text, plan) if plan.mode == "required" else []), False
    if plan.mode == "named":
        return [ToolCall(plan.named or "", dump_json(doc))], True
    calls = [_call(c, plan) for c in doc] if isinstance(doc, list) else []
    return [c for c in calls if c is not None], True


def _call(item: Any, plan: ToolPlan) -> ToolCall | None:
    if isinstance(item, dict) and item.get("name") in plan.names and "arguments" in item:
        return ToolCall(item["name"], dump_json(item["arguments"]))
    return None


def _finished_items(text: str, plan: ToolPlan) -> list[ToolCall]:
    """The whole items at the start of a JSON array that was cut off."""
    decoder, calls = json.JSONDecoder(), []
    i = len(text) - len(text.lstrip())
    if not text.startswith("[", i):
        return calls
    i += 1
    while True:
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        try:
            item, i = decoder.raw_decode(text, i)
        except ValueError:
            return calls
        call = _call(item, plan)
        if call is None:
            return calls
        calls.append(call)
        while i < len(text) and text[i] in " \t\r\n":
            i += 1
        if not text.startswith(",", i):
            return calls
        i += 1
