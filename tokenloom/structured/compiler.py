"""Compile a structured-output spec into an xgrammar grammar, once per distinct spec.

Compiling walks the grammar against every token of the vocabulary: milliseconds for a small
schema on a small vocabulary, much longer for a large one or a deeply nested one.  So
compiling happens before a request reaches the engine -- the server compiles at admission,
`LLM.generate` compiles its distinct specs before adding any request -- and the engine
thread finds the grammar in this cache.  A request whose grammar was evicted in between is
compiled again on the engine thread, as a fallback.

Where it compiles:

- offline (`LLM`), in this process, in threads (`precompile`);
- in the server, in worker processes (`use_pool`, `compile_pool.py`) that can be killed: a
  compilation that outlives `--max-grammar-compile-seconds`, or whose every client has
  disconnected (`compile_async` cancelled), is stopped, and at most
  `--max-concurrent-grammar-compiles` run at once.

The cache is keyed by `(kind, text)` (`StructuredOutputsParams.spec()`) and bounded twice:
by count (`CACHE_SIZE`) and by bytes (each grammar weighs its serialized size, which tracks
the memory it holds; `memory_size_bytes` undercounts by ~4x), least recently used first.
Its lock guards only the dictionary: requests for the same new spec share one compilation,
and a long compilation never blocks a lookup of another spec.  A spec whose compilation ran
out of time is remembered (by hash), so asking again is refused at once.
"""

from __future__ import annotations

import asyncio
import hashlib
import threading
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from tokenloom.sampling_params import SamplingParamError, StructuredOutputsParams
from tokenloom.structured.compile_pool import CompileError, CompilePool, CompilersBusy, CompileTimeout, SpecError
from tokenloom.structured.xgr_specs import SPEC_ERRORS, compile_spec, spec_error_message

if TYPE_CHECKING:
    import xgrammar

    from tokenloom.structured.state import GrammarState

CACHE_SIZE = 256  # distinct specs kept compiled
DEFAULT_CACHE_BYTES = 128 * 2**20
_TOO_COSTLY_REMEMBERED = 1024


class GrammarError(SamplingParamError):
    """A spec that gave no grammar; `param` names the field the caller should blame
    ("structured_outputs" unless told otherwise).  `status` and `code` say how the server
    answers: 400 `invalid_value` for a bad schema, regex or grammar, 400 `limit_exceeded`
    for one that takes too long to compile, 429 when every compile worker stays busy."""

    def __init__(self, param: str, message: str, *, status: int = 400, code: str = "invalid_value"):
        super().__init__(param, message)
        self.status = status
        self.code = code


def _require_xgrammar():
    try:
        import xgrammar
    except ImportError:
        raise GrammarError("structured_outputs", "structured output needs the xgrammar package "
                           "(a dependency of tokenloom: pip install xgrammar)") from None
    return xgrammar


@dataclass
class _Entry:
    """A cached grammar, or one being compiled (`future` not done yet)."""

    future: Future  # -> CompiledGrammar, or a CompileError
    waiters: int = 0  # callers waiting on `future`; the last async one to leave cancels it
    job: Any = None  # the pool's CompileJob, when compiled there
    size: int = 0  # bytes, once compiled


class GrammarCompiler:
    """Compiles specs for one tokenizer and model vocabulary, caching the results.

    `vocab_size` is the *model's* vocabulary (the logits' width), which may exceed the
    tokenizer's: the extra ids are given to xgrammar as tokens no grammar ever allows.
    `stop_token_ids` are the ids that end a request (the engine's EOS set): a grammar that
    is complete allows exactly these."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], max_threads: int = 4,
                 cache_bytes: int = DEFAULT_CACHE_BYTES):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.cache_bytes = cache_bytes
        self._max_threads = max_threads
        self._info: "xgrammar.TokenizerInfo | None" = None
        self._xgr_compiler: "xgrammar.GrammarCompiler | None" = None
        self._pool: CompilePool | None = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[tuple[str, str], _Entry] = OrderedDict()
        self._bytes = 0
        self._too_costly: OrderedDict[bytes, str] = OrderedDict()

    # -- set-up ---------------------------------------------------------------------------

    def use_pool(self, *, workers: int, compile_seconds: float, wait_seconds: float | None = None,
                 cache_bytes: int | None = None) -> None:
        """Compile in `workers` killable processes from now on, each compilation held to
        `compile_seconds` (the server's way; see compile_pool.py).  Processes start on the
        first compilation.  A job waits at most `wait_seconds` (default: `compile_seconds`)
        for a free worker."""
        _require_xgrammar()
        with self._lock:
            if self._pool is not None:
                raise RuntimeError("this GrammarCompiler already compiles in a pool")
            if cache_bytes is not None:
                self.cache_bytes = cache_bytes
            self._pool = CompilePool(lambda: self._tokenizer_info().serialize_json(), workers=workers,
                                     compile_seconds=compile_seconds,
                                     wait_seconds=compile_seconds if wait_seconds is None else wait_seconds)

    def close(self) -> None:
        """Stop the compile workers, if any (the server's shutdown)."""
        pool = self._pool
        if pool is not None:
            pool.close()

    def _tokenizer_info(self) -> "xgrammar.TokenizerInfo":
        xgr = _require_xgrammar()
        with self._lock:
            if self._info is None:  # built on first use: it reads the whole vocabulary
                self._info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                                stop_token_ids=self.stop_token_ids or None)
            return self._info

    def _compiler(self) -> "xgrammar.GrammarCompiler":
        xgr = _require_xgrammar()
        info = self._tokenizer_info()
        with self._lock:
            if self._xgr_compiler is None:
                # xgrammar keeps its own cache too; ours bounds it and shares in-flight work.
                self._xgr_compiler = xgr.GrammarCompiler(info, max_threads=self._max_threads, cache_enabled=False)
            return self._xgr_compiler

    # -- compiling ------------------------------------------------------------------------

    def compile(self, params: StructuredOutputsParams, param: str = "structured_outputs") -> "xgrammar.CompiledGrammar":
        """The compiled grammar of `params` (from the cache when it is there).  Blocking:
        call it off the event loop.  Raises GrammarError naming `param`."""
        key = self._key(params, param)
        entry, owner = self._join(key, param)
        try:
            if owner:
                self._start(key, entry)
            return self._result(entry.future, key, param)
        finally:
            self._leave(key, entry)

    async def compile_async(self, params: StructuredOutputsParams,
                            param: str = "structured_outputs") -> "xgrammar.CompiledGrammar":
        """`compile` for the event loop.  With a pool, cancelling this (the client left)
        stops the compilation once no other request waits for the same spec."""
        if self._pool is None:
            return await asyncio.to_thread(self.compile, params, param)
        key = self._key(params, param)
        entry, owner = self._join(key, param)
        try:
            if owner:
                self._start(key, entry)
            await _wait_on_loop(entry.future)
            return self._result(entry.future, key, param)
        finally:
            self._leave(key, entry)

    def _key(self, params: StructuredOutputsParams, param: str) -> tuple[str, str]:
        try:
            return params.spec()
        except SamplingParamError as e:
            raise GrammarError(param, str(e).removeprefix("structured_outputs: ")) from None

    def _join(self, key: tuple[str, str], param: str) -> tuple[_Entry, bool]:
        """The entry for `key` with one more waiter, and whether the caller must start it."""
        with self._lock:
            refused = self._too_costly.get(_digest(key))
            if refused is not None:
                raise GrammarError(param, refused, code="limit_exceeded")
            entry = self._cache.get(key)
            if entry is not None:
                self._cache.move_to_end(key)
                entry.waiters += 1
                return entry, False
            entry = self._cache[key] = _Entry(Future(), waiters=1)
            return entry, True

    def _start(self, key: tuple[str, str], entry: _Entry) -> None:
        """Compile in the pool (returns at once) or here (returns when done)."""
        pool = self._pool
        if pool is not None:
            xgr = _require_xgrammar()
            info = self._tokenizer_info()

            def decode(serialized: str) -> tuple[Any, int]:  # runs on the pool's slot thread
                return xgr.CompiledGrammar.deserialize_json(serialized, info), len(serialized)

            entry.job = pool.submit(key[0], key[1], decode)
            entry.job.future.add_done_callback(lambda f: self._settle(key, entry, f))
            return
        done: Future = Future()
        try:
            compiled = compile_spec(self._compiler(), *key)
            done.set_result((compiled, len(compiled.serialize_json())))
        except SPEC_ERRORS as e:
            done.set_exception(SpecError(f"{key[0]}: {spec_error_message(e)}"))
        except BaseException as e:  # noqa: BLE001 - handed to every waiter, raised there
            done.set_exception(e)
        self._settle(key, entry, done)

    def _settle(self, key: tuple[str, str], entry: _Entry, done: Future) -> None:
        """A compilation ended: cache the grammar (within the bounds) or forget the spec."""
        exc = done.exception()
        with self._lock:
            if exc is not None:
                if self._cache.get(key) is entry:  # a failure is not cached: the next request tries again
                    del self._cache[key]
                if isinstance(exc, CompileTimeout):
                    self._too_costly[_digest(key)] = f"{key[0]}: {exc}"
                    while len(self._too_costly) > _TOO_COSTLY_REMEMBERED:
                        self._too_costly.popitem(last=False)
            else:
                compiled, entry.size = done.result()
                if self._cache.get(key) is entry:
                    if entry.size > self.cache_bytes:  # would flush everything else: used, not kept
                        del self._cache[key]
                    else:
                        self._bytes += entry.size
                        self._evict_locked(keep=entry)
        if exc is not None:
            entry.future.set_exception(exc)
        else:
            entry.future.set_result(compiled)

    def _evict_locked(self, keep: _Entry) -> None:
        # Least recently used first.  Entries being compiled have no size yet and stay; an
        # entry whose waiters are about to be told (its size set, its future not yet) may go:
        # they hold the entry itself.
        for k in list(self._cache):
            if self._bytes <= self.cache_bytes and len(self._cache) <= CACHE_SIZE:
                return
            e = self._cache[k]
            if e is not keep and e.size:
                del self._cache[k]
                self._bytes -= e.size

    def _leave(self, key: tuple[str, str], entry: _Entry) -> None:
        with self._lock:
            entry.waiters -= 1
            if entry.waiters > 0 or entry.future.done():
                return
            if self._cache.get(key) is entry:  # nobody waits: stop it, and let a later request start afresh
                del self._cache[key]
                self._bytes -= entry.size  # non-zero only if it settled a moment ago
            job = entry.job
        if job is not None:
            job.cancel()

    def _result(self, fut: Future, key: tuple[str, str], param: str) -> "xgrammar.CompiledGrammar":
        try:
            return fut.result()
        except CompilersBusy as e:
            raise GrammarError(param, str(e), status=429, code=e.code) from None
        except CompileTimeout as e:
            raise GrammarError(param, f"{key[0]}: {e}", code=e.code) from None
        except CompileError as e:
            raise GrammarError(param, str(e), code=e.code) from None

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

    # -- what /metrics shows ----------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """The cache's entries and bytes against its bound, and the pool's picture (if any)."""
        with self._lock:
            out: dict[str, Any] = {"cache_entries": sum(1 for e in self._cache.values() if e.future.done()),
                                   "cache_bytes": self._bytes, "cache_limit_bytes": self.cache_bytes}
        if self._pool is not None:
            out["pool"] = self._pool.snapshot()
        return out


def _digest(key: tuple[str, str]) -> bytes:
    return hashlib.sha256(f"{key[0]}\0{key[1]}".encode("utf-8", "surrogatepass")).digest()


async def _wait_on_loop(fut: Future) -> None:
    """Wait for a concurrent Future without tying its fate to ours: cancelling this wait
    leaves `fut` alone (the caller decides, in `_leave`, whether to cancel the job)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()

    def wake(_: Future) -> None:
        try:
            loop.call_soon_threadsafe(lambda: waiter.done() or waiter.set_result(None))
        except RuntimeError:  # the loop closed meanwhile: nobody is waiting
            pass

    fut.add_done_callback(wake)
    await waiter
