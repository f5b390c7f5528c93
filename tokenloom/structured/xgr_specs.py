"""What xgrammar is asked to compile for each kind of spec, and how its errors read.

Shared by the two places a grammar is compiled: this process (`LLM.generate`, the engine's
fallback) and the server's compile worker processes (`compile_worker.py`).  Nothing here
keeps state; `compile_spec` is a pure function of the compiler and the spec.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import xgrammar

# What xgrammar raises for a spec it cannot compile: RuntimeError for parse errors,
# ValueError for schemas it rejects, and UnicodeDecodeError when its C++ error message
# holds a cut UTF-8 sequence (it quotes the offending *byte* of a non-ASCII character,
# e.g. "Unexpected character: \xc3", which its binding then fails to decode).
SPEC_ERRORS: tuple[type[BaseException], ...] = (RuntimeError, ValueError, UnicodeDecodeError)


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of `choices` (JSON string escapes are also
    xgrammar's EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def compile_spec(compiler: "xgrammar.GrammarCompiler", kind: str, text: str) -> "xgrammar.CompiledGrammar":
    """Compile one `(kind, text)` spec (`StructuredOutputsParams.spec()`).  Raises one of
    `SPEC_ERRORS` for a spec that does not compile."""
    if kind == "json":
        return _compile_schema(compiler, text)
    if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "choice":
        return compiler.compile_grammar(choice_grammar(json.loads(text)))
    return compiler.compile_grammar(text)


# xgrammar (0.2.9) spells a character of a length-bounded string (minLength/maxLength) as
# [^"\\\r\n], which lets raw control characters through -- and no JSON parser accepts those
# inside a string.  Its unbounded strings exclude them; the bounded ones are made to as well.
_LOOSE_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\]'


def _compile_schema(compiler: "xgrammar.GrammarCompiler", schema: str) -> "xgrammar.CompiledGrammar":
    """A JSON schema as compact JSON (one space after ':' and ','): no runs of free whitespace
    for a model to wander in before it closes the document."""
    import xgrammar as xgr

    grammar = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    if _LOOSE_STRING_CHAR in grammar:
        try:
            return compiler.compile_grammar(grammar.replace(_LOOSE_STRING_CHAR, _JSON_STRING_CHAR))
        except SPEC_ERRORS:  # the printed grammar did not parse back: keep xgrammar's own
            pass
    return compiler.compile_json_schema(schema, any_whitespace=False)


def spec_error_message(e: BaseException) -> str:
    """xgrammar's message, readable: a cut UTF-8 sequence decoded with replacement characters,
    the first line only, without its C++ source location prefix."""
    if isinstance(e, UnicodeDecodeError) and isinstance(e.object, (bytes, bytearray)):
        text = bytes(e.object).decode("utf-8", errors="replace")
    else:
        text = str(e)
    msg = text.strip().splitlines()[0] if text.strip() else type(e).__name__
    if "] " in msg and msg.startswith("["):
        msg = msg.split("] ", 1)[1]
    if ": " in msg and ".cc:" in msg.split(": ", 1)[0]:
        msg = msg.split(": ", 1)[1]
    return msg
