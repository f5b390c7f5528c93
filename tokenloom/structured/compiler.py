"""Compile a structured-output spec into an xgrammar grammar, once per distinct spec.

Compiling walks the grammar against every token of the vocabulary: milliseconds for a small
schema on a small vocabulary, much longer for a large one.  So compiling happens before a
request reaches the engine -- the server compiles at admission in a worker thread, `LLM.generate`
compiles its distinct specs before adding any request -- and the engine thread finds the
grammar in this cache.  A request whose grammar was evicted in between is compiled on the
engine thread, as a fallback.

The cache is keyed by `(kind, text)` (`StructuredOutputsParams.spec()`).  Its lock guards only
the dictionary: two threads asking for the same new spec share one compilation (a Future), and
a long compilation never blocks a lookup of another spec.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Iterable

from tokenloom.sampling_params import SamplingParamError, StructuredOutputsParams

if TYPE_CHECKING:
    import xgrammar

CACHE_SIZE = 256  # distinct specs kept compiled


class GrammarError(SamplingParamError):
    """A spec xgrammar cannot compile (a bad schema, regex or grammar); `param` names the
    field the caller should blame ("structured_outputs" unless told otherwise)."""


def _require_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured_outputs", "structured output needs the xgrammar package "
                           "(pip install 'tokenloom[structured]')") from None
    return xgrammar


def _choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar that matches exactly one of `choices` (JSON string escapes are also
    xgrammar's EBNF escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, caching the results.

    `vocab_size` is the *model's* vocabulary (the logits' width), which may exceed the
    tokenizer's: the extra ids are given to xgrammar as tokens no grammar ever allows.
    `stop_token_ids` are the ids that end a request (the engine's EOS set): a grammar that
    is complete allows exactly these."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 4):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._max_threads = max_threads
        self._xgr_compiler: "xgrammar.GrammarCompiler | None" = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def _compiler(self) -> "xgrammar.GrammarCompiler":
        xgr = _require_xgrammar()
        with self._lock:
            if self._xgr_compiler is None:  # built on first use: it reads the whole vocabulary
                info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids or None)
                # xgrammar keeps its own cache too; ours bounds the count and shares in-flight work.
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._xgr_compiler

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> "xgrammar.CompiledGrammar":
        """The compiled grammar of `params` (from the cache when it is there).  Blocking:
        call it off the event loop.  Raises GrammarError naming `param` if it does not compile."""
        try:
            key = params.spec()
        except SamplingParamError as e:
            raise GrammarError(param, str(e).removeprefix("structured_outputs: ")) from None
        compiler = self._compiler()
        with self._lock:
            fut = self._cache.get(key)
            owner = fut is None
            if owner:
                fut = self._cache[key] = Future()
                if len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
            else:
                self._cache.move_to_end(key)
        if owner:
            try:
                fut.set_result(self._compile(compiler, *key))
            except Exception as e:
                with self._lock:  # a bad spec is not cached: the next request gets its own error
                    if self._cache.get(key) is fut:
                        del self._cache[key]
                fut.set_exception(e)
        try:
            return fut.result()
        except RuntimeError as e:  # xgrammar reports parse errors as RuntimeError
            raise GrammarError(param, f"{key[0]}: {_short(e)}") from None

    @staticmethod
    def _compile(compiler: "xgrammar.GrammarCompiler", kind: str, text: str) -> "xgrammar.CompiledGrammar":
        if kind == "json":
            return _compile_schema(compiler, text)
        if kind == "json_object":  # OpenAI's json_object: an object, not any JSON value
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            return compiler.compile_grammar(_choice_grammar(json.loads(text)))
        return compiler.compile_grammar(text)

    def precompile(self, specs: Iterable[StructuredOutputsParams | None]) -> None:
        """Compile the distinct specs among `specs` in parallel, before their requests are
        added.  Errors are left for `compile` to raise when that request is added."""
        todo = {}
        for p in specs:
            if p is not None:
                try:
                    todo.setdefault(p.spec(), p)
                except SamplingParamError:
                    pass
        if not todo:
            return
        from concurrent.futures import ThreadPoolExecutor

        def quiet(p: StructuredOutputsParams) -> None:
            try:
                self.compile(p)
            except GrammarError:
                pass

        with ThreadPoolExecutor(max_workers=min(len(todo), self._max_threads)) as pool:
            list(pool.map(quiet, todo.values()))

    def new_state(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> "GrammarState":
        """A fresh matcher for one request (its own position in the grammar)."""
        from tokenloom.structured.state import GrammarState

        return GrammarState(self.compile(params, param), self.vocab_size)


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
        except RuntimeError:  # the printed grammar did not parse back: keep xgrammar's own
            pass
    return compiler.compile_json_schema(schema, any_whitespace=False)


def _short(e: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix."""
    msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "] " in msg and msg.startswith("["):
        msg = msg.split("] ", 1)[1]
    if ": " in msg and ".cc:" in msg.split(": ", 1)[0]:
        msg = msg.split(": ", 1)[1]
    return msg
