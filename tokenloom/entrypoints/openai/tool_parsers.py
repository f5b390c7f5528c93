"""Reading a model's own tool-call format (tool_choice "auto"), and choosing the format.

- `hermes`: Hermes / Qwen2.5 / Qwen3 write `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `llama3_json`: Llama 3.1 / 3.2 answer with the call itself, `{"name": ..., "parameters": {...}}`.

`--tool-call-parser` picks one; without it the server picks by the chat template's family
(`parser_for_template`): a template that tells the model to write `<tool_call>` is Hermes-style,
one with Llama 3's `<|python_tag|>` and header tokens is Llama 3 JSON.  A template of neither
family gets no parser, and `auto` then answers in text (tool_calls.plan_tools).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any

from tokenloom.entrypoints.openai.tool_calls import ToolCall, dump_json

TOOL_CALL_PARSERS = ("hermes", "llama3_json")


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
    return ToolCall(obj["name"], dump_json(args))


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


@lru_cache(maxsize=16)
def parser_for_template(template: str | None) -> str | None:
    """The tool-call parser that reads what a model with this chat template writes, or None
    when the template belongs to no family we parse (or prints no tools at all).

    Hermes-style templates (Qwen2.5, Qwen3, Hermes 2/3) show the model `<tool_call>` tags;
    Llama 3.1/3.2 templates use `<|python_tag|>` / `<|start_header_id|>` and ask for
    `"parameters"`.  A template that never mentions `tools` cannot have shown any to the model."""
    if not template or "tools" not in template:
        return None
    if "<tool_call>" in template:
        return "hermes"
    if "<|start_header_id|>" in template and ("<|python_tag|>" in template or '"parameters"' in template):
        return "llama3_json"
    return None
