"""What /v1/completions and /v1/chat/completions share.

- `ServingContext`: the async engine plus the server's settings (served names, limits).
- Request -> `SamplingParams` with errors mapped to 400s that name the field.
- Admission: model name (404), per-request limits (400), queue cap (429), prompt
  validation (400) -- all checked *before* anything reaches the engine, so a bad request
  never disturbs running ones.  Counting comes first; tokenizing, templating and checking
  token ids run in a worker thread, so a huge prompt never holds up the event loop (and
  with it every other stream) while it is being refused.
- Fan-in of several request streams, and a watcher that turns a client's disconnect into
  an abort (non-streaming responses would otherwise run to the end for nobody).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import re
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Literal, Sequence, TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse

from tokenloom.engine.async_engine import (AsyncLLMEngine, EngineDeadError, RequestFailedError,
                                           RequestStream, StallPolicy)
from tokenloom.engine.llm_engine import PromptTooLongError
from tokenloom.engine.prompt_bound import prompt_bound
from tokenloom.entrypoints.openai.errors import (OpenAIError, bad_request, context_length_exceeded, grammar_error,
                                                 sse_error)
from tokenloom.entrypoints.openai.limits import ServerLimits, check_sampling_limits
from tokenloom.entrypoints.openai.lora_models import LoRAModels
from tokenloom.entrypoints.openai.reasoning_parsers import ReasoningParser, get_reasoning_parser
from tokenloom.entrypoints.openai.protocol import LOGIT_BIAS_KEY, PromptTokensDetails, Usage, _SamplingFields
from tokenloom.outputs import RequestOutput
from tokenloom.request import LoRARequest
from tokenloom.sampling_params import SamplingParamError, SamplingParams, StructuredOutputsParams
from tokenloom.structured import GrammarError

logger = logging.getLogger("tokenloom.server")
_T = TypeVar("_T")
_SEED_MIN, _SEED_MAX = -(2**63), 2**63 - 1  # torch.Generator.manual_seed takes a 64-bit value
_LOGIT_BIAS_KEY = re.compile(LOGIT_BIAS_KEY.strip("^$"), re.ASCII)


@dataclass
class ServingContext:
    engine: AsyncLLMEngine
    served_model_names: list[str]
    limits: ServerLimits = field(default_factory=ServerLimits)
    created: int = field(default_factory=lambda: int(time.time()))
    tool_call_parser: str | None = None  # --tool-call-parser: reads tool_choice "auto" answers
    model_aliases: list[str] = field(default_factory=list)  # accepted in requests, not listed (model_names.py)
    reasoning_parser: str | None = None  # --reasoning-parser: splits <think> ... </think> off the answer
    max_stored_responses: int = 1024  # --max-stored-responses: the Responses API's memory (responses_store.py)
    reasoning: ReasoningParser | None = field(init=False, default=None)
    loras: LoRAModels = field(init=False)  # LoRA adapters served by name (--enable-lora)

    def __post_init__(self) -> None:
        self.loras = LoRAModels(self.engine, self.served_model_names, self.model_aliases)
        if self.reasoning_parser is not None:  # ValueError naming the flag when the tokenizer lacks the tags
            self.reasoning = get_reasoning_parser(self.reasoning_parser, self.engine.tokenizer)
        # The server compiles grammars in worker processes it can kill (started on the first
        # grammar), bounded by the --max-grammar-* limits; see `compile_grammar`.
        grammars = self.engine.engine.grammars
        with contextlib.suppress(GrammarError):  # no xgrammar: each request for structure is a 400
            grammars.use_pool(workers=self.limits.max_concurrent_grammar_compiles,
                              compile_seconds=self.limits.max_grammar_compile_seconds,
                              cache_bytes=self.limits.max_grammar_cache_bytes)
        if self.engine.metrics is not None:
            from tokenloom.entrypoints.openai.grammar_metrics import register_grammar_metrics

            register_grammar_metrics(self.engine.metrics.registry, grammars, self.served_model_names[0])

    def close(self) -> None:
        """Stop what the server started beside the engine: the grammar compile workers."""
        self.engine.engine.grammars.close()

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model); 404 for a name
        this server does not serve."""
        if model is None or model in self.served_model_names or model in self.model_aliases:
            return None
        lora = self.loras.get(model)
        if lora is None:
            served = [*self.served_model_names, *self.loras.by_name]
            raise OpenAIError(404, f"the model {model!r} does not exist; this server serves "
                                   f"{', '.join(repr(n) for n in served)}",
                              param="model", code="model_not_found")
        return lora

    def check_capacity(self, num_new: int) -> None:
        """429 (retry later, as OpenAI and vLLM answer overload) when admitting `num_new` more
        sequences would grow the waiting queue past the cap."""
        cap = self.limits.max_queued_requests
        if cap is None:
            return
        if num_new > cap:  # never admissible, however long the client waits: not a 429
            raise bad_request(f"this request needs {num_new} sequences (prompts x n), more than may wait at once "
                              f"(--max-queued-requests {cap})", param="n", code="limit_exceeded")
        waiting = self.engine.num_waiting()
        if waiting + num_new > cap:
            raise OpenAIError(429, f"the server is overloaded: {waiting} request(s) are already waiting "
                                   f"(--max-queued-requests {cap}); retry later",
                              code="queue_full", headers={"Retry-After": "1"})

    def check_engine(self) -> None:
        if not self.engine.is_running:
            raise OpenAIError(503, self.engine.dead_reason or "the engine is not running", code="engine_unavailable")


def finite_logprob(x: float) -> float:
    """JSON has no -Infinity: a token the model rules out entirely reports -9999 (as vLLM does)."""
    return x if math.isfinite(x) else -9999.0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


async def off_loop(fn: Callable[..., _T], *args: Any, **kwargs: Any) -> _T:
    """Run `fn` in a worker thread: tokenizers and chat templates release the event loop
    (the Rust tokenizer drops the GIL while it works), so streams keep flowing meanwhile."""
    return await asyncio.to_thread(fn, *args, **kwargs)


def check_request(ctx: ServingContext, req: _SamplingFields) -> LoRARequest | None:
    """What every generation request must satisfy before any work is done for it; returns
    the LoRA adapter its `model` names (None: the base model)."""
    lora = ctx.check_model(req.model)
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
    check_sampling_limits(ctx.limits, n=req.n, stop=req.stop, logit_bias=req.logit_bias,
                          token_lists={"stop_token_ids": req.stop_token_ids,
                                       "allowed_token_ids": req.allowed_token_ids},
                          vocab_size=ctx.engine.engine.vocab_size)
    return lora


def sampling_params(req: _SamplingFields, *, max_tokens: int | None, logprobs: int | None,
                    prompt_logprobs: int | None) -> SamplingParams:
    """Build and validate SamplingParams; any bad value is a 400 naming its field.
    (Call `check_request` first: it bounds the sizes this loops over.)"""
    logit_bias = None
    if req.logit_bias:
        # JSON object keys are strings; OpenAI's are token ids in decimal ("5", not "+5", "05" or "5_0",
        # which int() would take): the pattern the OpenAPI document states
        if not all(_LOGIT_BIAS_KEY.fullmatch(k) for k in req.logit_bias):
            raise bad_request("logit_bias keys must be token ids (integers as strings)", param="logit_bias")
        logit_bias = {int(k): v for k, v in req.logit_bias.items()}
    if req.seed is not None and not _SEED_MIN <= req.seed <= _SEED_MAX:
        raise bad_request(f"seed must fit in a signed 64-bit integer, got {req.seed}", param="seed")
    kw: dict = dict(
        n=req.n,
        presence_penalty=req.presence_penalty,
        frequency_penalty=req.frequency_penalty,
        seed=req.seed,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        stop=req.stop,
        stop_token_ids=req.stop_token_ids,
        include_stop_str_in_output=req.include_stop_str_in_output,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        logit_bias=logit_bias,
        allowed_token_ids=req.allowed_token_ids,
        structured_outputs=structured_outputs(req)[0],
    )
    # Unset optional knobs keep SamplingParams' own defaults.
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        v = getattr(req, name)
        if v is not None:
            kw[name] = v
    try:
        return SamplingParams(**kw)
    except SamplingParamError as e:
        raise bad_request(str(e), param=e.param) from None
    except (TypeError, ValueError) as e:
        raise bad_request(str(e)) from None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_KEYS = ("json", "regex", "choice", "grammar", "json_object")


def structured_outputs(req: _SamplingFields) -> tuple[StructuredOutputsParams | None, str]:
    """The output constraint a request asks for, and the field it came from (the one a 400
    names): `response_format` (OpenAI), `structured_outputs` or `guided_*` (vLLM)."""
    found: list[tuple[StructuredOutputsParams, str]] = []
    rf = req.response_format
    if rf is not None:
        kind = rf.get("type", "text")
        if kind == "json_object":
            found.append((StructuredOutputsParams(json_object=True), "response_format"))
        elif kind == "json_schema":
            js = rf.get("json_schema")
            schema = js.get("schema") if isinstance(js, dict) else None
            if not isinstance(schema, dict):
                raise bad_request("response_format.json_schema.schema must be a JSON schema object",
                                  param="response_format")
            found.append((StructuredOutputsParams(json=schema), "response_format"))
        elif kind != "text":
            raise bad_request(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                              param="response_format")
    if req.structured_outputs is not None:
        so = {k: v for k, v in req.structured_outputs.items() if k in _STRUCTURED_KEYS and v is not None}
        if not so:
            raise bad_request(f"structured_outputs needs one of {', '.join(_STRUCTURED_KEYS)}",
                              param="structured_outputs")
        try:
            found.append((StructuredOutputsParams(**so), "structured_outputs"))
        except TypeError as e:
            raise bad_request(f"structured_outputs: {e}", param="structured_outputs") from None
    for name, key in _GUIDED.items():
        v = getattr(req, name)
        if v is not None:
            found.append((StructuredOutputsParams(**{key: v}), name))
    if len(found) > 1:
        raise bad_request(f"give one output constraint, not {len(found)} ({', '.join(f for _, f in found)})",
                          param=found[1][1])
    if not found:
        return None, ""
    spec, field_name = found[0]
    try:
        spec.spec()
    except SamplingParamError as e:
        raise bad_request(f"{field_name}: {str(e).removeprefix('structured_outputs: ')}", param=field_name) from None
    return spec, field_name


async def compile_grammar(ctx: ServingContext, req: _SamplingFields, params: SamplingParams,
                          raw: Request | None = None, *, param: str | None = None) -> None:
    """Compile the request's grammar at admission, so that the engine thread finds it
    compiled (`tokenloom.structured.compiler`), in a worker process held to
    --max-grammar-compile-seconds.  A bad schema, regex or grammar, or one that takes too
    long, is a 400 naming the field it came from (`param`, else the structured-output field
    the request used); a 429 when every compile worker stayed busy.  Given the request
    (`raw`), a client that disconnects meanwhile stops the compilation (unless another
    request waits for the same grammar)."""
    if params.structured_outputs is None:
        return
    field_name = param or structured_outputs(req)[1]
    work = asyncio.ensure_future(ctx.engine.engine.grammars.compile_async(params.structured_outputs, field_name))
    watch = asyncio.ensure_future(_wait_disconnect(raw)) if raw is not None else None
    try:
        await asyncio.wait({work} if watch is None else {work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # also when this handler is cancelled: the compilation is not left running for nobody
        if watch is not None:
            watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.wait({work})  # its way out tells the compiler nobody waits any more
    if work.cancelled():
        raise OpenAIError(499, "the client disconnected while its grammar was being compiled",
                          param=field_name, code="client_disconnected")
    try:
        work.result()
    except GrammarError as e:  # named after the field the client sent, whatever the compiler said
        raise grammar_error(e, field_name) from None


def check_prompt_bound(ctx: ServingContext, text: str, param: str = "prompt") -> None:
    """Refuse, before tokenizing it, a text that cannot fit max_model_len: it has at least
    bytes / L tokens (`tokenloom.engine.prompt_bound`), so a prompt that passes this costs at
    most L x max_model_len bytes of tokenizing, however large the body."""
    max_len = ctx.engine.max_model_len
    least = prompt_bound(ctx.engine.tokenizer).min_tokens(text)
    if least >= max_len:
        raise context_length_exceeded(max_len, f"at least {least}", None, where=param, param=param)


def tokenize_limit(ctx: ServingContext) -> int:
    """The most tokens /tokenize counts: --max-tokenize-tokens, or max_model_len if larger."""
    return max(ctx.limits.max_tokenize_tokens, ctx.engine.max_model_len)


def _too_many_to_count(num_tokens: int | str, limit: int, param: str) -> OpenAIError:
    return bad_request(f"the text has {num_tokens} tokens, more than /tokenize counts ({limit}: "
                       f"--max-tokenize-tokens, or max_model_len if larger)", param=param, code="limit_exceeded")


def encode_text(ctx: ServingContext, text: str, *, add_special_tokens: bool, param: str,
                route: Literal["generate", "tokenize"] = "generate") -> list[int]:
    """Token ids of `text`, refused by its length before tokenizing when it cannot fit the
    limit it is for: max_model_len for generation (`check_prompt_bound`), `tokenize_limit`
    for /tokenize (which counts texts longer than the context, as vLLM's does: lm-eval-harness
    tokenizes whole documents through it, then cuts them into context windows).  Blocking:
    call it off the event loop."""
    tok = ctx.engine.tokenizer
    if route == "generate":
        check_prompt_bound(ctx, text, param)
        return tok.encode(text, add_special_tokens=add_special_tokens)
    limit = tokenize_limit(ctx)
    least = prompt_bound(tok).min_tokens(text)
    if least > limit:
        raise _too_many_to_count(f"at least {least}", limit, param)
    ids = tok.encode(text, add_special_tokens=add_special_tokens)
    if len(ids) > limit:
        raise _too_many_to_count(len(ids), limit, param)
    return ids


def validate_prompt(ctx: ServingContext, prompt: str | list[int], params: SamplingParams,
                    param: str = "prompt") -> tuple[str | None, list[int]]:
    """Tokenize/check one prompt as the engine will; PromptTooLongError etc. become 400s.
    Blocking (a tokenizer, a pass over the ids): call it through `off_loop`."""
    max_len = ctx.engine.max_model_len
    if isinstance(prompt, str):
        check_prompt_bound(ctx, prompt, param)
    elif len(prompt) >= max_len:  # the length first, before any per-id check
        raise context_length_exceeded(max_len, len(prompt), None, where=param, param=param)
    try:
        return ctx.engine.validate(prompt, params)
    except PromptTooLongError as e:
        # In OpenAI's words (errors.context_length_exceeded); the field to blame: the prompt
        # if it alone is too long, otherwise max_tokens.
        raise context_length_exceeded(e.max_model_len, e.prompt_tokens, e.max_tokens, where=param,
                                      param=param if e.max_tokens is None else "max_tokens") from None
    except SamplingParamError as e:
        raise bad_request(str(e), param=e.param) from None
    except ValueError as e:
        raise bad_request(str(e), param=param) from None


def add_requests(ctx: ServingContext, base_id: str, prompts: Sequence[tuple[str | None, list[int]]],
                 params: Any, *, priority: int, cache_salt: str | None,
                 lora_request: LoRARequest | None = None) -> list[RequestStream]:
    """Queue validated prompts (one engine request each, on `lora_request`'s adapter if
    given); 503 if over capacity.  `params`: one set for every prompt (SamplingParams,
    BeamSearchParams or PoolingParams), or a list of one per prompt."""
    ctx.check_engine()
    each = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
    ctx.check_capacity(sum(p.n for p in each))
    arrival = time.perf_counter()
    try:
        return [ctx.engine.add_request(f"{base_id}-{i}", text, ids, p, arrival_time=arrival,
                                       priority=priority, cache_salt=cache_salt, lora_request=lora_request)
                for i, ((text, ids), p) in enumerate(zip(prompts, each))]
    except EngineDeadError as e:
        raise OpenAIError(503, str(e), code="engine_unavailable") from None
    except ValueError as e:  # its adapter was unloaded since the request named it
        raise OpenAIError(404, str(e), param="model", code="model_not_found") from None


def abort_all(ctx: ServingContext, streams: Sequence[RequestStream]) -> None:
    for s in streams:
        if not s.finished:
            ctx.engine.abort(s.request_id)


def engine_failure(e: BaseException) -> OpenAIError:
    if isinstance(e, EngineDeadError):
        return OpenAIError(503, str(e), code="engine_unavailable")
    status = getattr(e, "status", 500)
    if status >= 500 and status != 503:
        # The engine's message may carry an exception's text: the log gets it, the client a summary.
        logger.error("request failed in the engine: %s", e)
        return OpenAIError(status, "the engine failed while running this request (the details are in the server log)",
                           code="engine_error")
    code = getattr(e, "code", None) or ("shutting_down" if status == 503 else "engine_error")
    return OpenAIError(status, str(e), code=code)


async def merge_streams(streams: Sequence[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (stream index, newest output) from several streams as they progress."""
    pending: dict[asyncio.Task, int] = {asyncio.ensure_future(s.next()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in sorted(done, key=lambda t: pending[t]):
                i = pending.pop(task)
                out = task.result()  # raises the stream's error, if any
                if out is None:
                    continue
                yield i, out
                pending[asyncio.ensure_future(streams[i].next())] = i
    finally:
        for task in pending:
            task.cancel()


async def _wait_disconnect(raw: Request) -> None:
    # The body has been read already, so the next ASGI message can only be the disconnect.
    while True:
        msg = await raw.receive()
        if msg["type"] == "http.disconnect":
            return


async def collect_final(ctx: ServingContext, streams: Sequence[RequestStream],
                        raw: Request) -> list[RequestOutput] | None:
    """Wait for every stream's final output; None (after aborting) if the client went away."""
    finals: list[RequestOutput | None] = [None] * len(streams)

    async def gather() -> None:
        async for i, out in merge_streams(streams):
            finals[i] = out

    work = asyncio.ensure_future(gather())
    watch = asyncio.ensure_future(_wait_disconnect(raw))
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        # Reached also when this handler itself is cancelled (server shutting down).
        if not work.done():
            work.cancel()
            abort_all(ctx, streams)
        watch.cancel()
    if not work.done() or work.cancelled():
        return None
    exc = work.exception()
    if exc is not None:
        abort_all(ctx, streams)
        if isinstance(exc, (EngineDeadError, RequestFailedError)):
            raise engine_failure(exc)
        raise exc
    return [f for f in finals if f is not None]


def make_usage(outputs: Sequence[RequestOutput], *, completion_tokens: int | None = None) -> Usage:
    prompt = sum(len(o.prompt_token_ids) for o in outputs)
    completion = completion_tokens if completion_tokens is not None else sum(
        len(c.token_ids) for o in outputs for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


class SSEResponse(StreamingResponse):
    """An SSE stream that aborts its engine requests however the response ends.

    The generator's own `finally` is not enough: if the client is gone before the first
    chunk, Starlette never starts the generator, so its cleanup would never run."""

    def __init__(self, body: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(body, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def dumps(obj: Any) -> str:
    """Compact JSON for SSE chunks (non-ASCII kept as is: fewer bytes per streamed token)."""
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def sse(payload: str) -> str:
    return f"data: {payload}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChunkFrame:
    """The envelope shared by every chunk of one streamed response.

    Each chunk repeats the response's id, object type, creation time and model; with
    `stream_options.continuous_usage_stats` each also carries the usage so far, and with
    `include_usage` a last chunk with empty `choices` carries the final usage."""

    def __init__(self, request_id: str, object_type: str, model: str, stream_options: Any,
                 *, score_only: bool = False) -> None:
        self.head = {"id": request_id, "object": object_type, "created": int(time.time()), "model": model}
        self.include_usage = bool(stream_options and stream_options.include_usage)
        self.continuous_usage = bool(stream_options and stream_options.continuous_usage_stats)
        self.completion_tokens = 0 if score_only else None  # scoring reports no generated token

    def chunk(self, choice: dict[str, Any], outputs: Sequence[RequestOutput]) -> str:
        obj: dict[str, Any] = {**self.head, "choices": [choice]}
        if self.continuous_usage and outputs:
            obj["usage"] = make_usage(outputs, completion_tokens=self.completion_tokens).model_dump()
        return sse(dumps(obj))

    def usage_chunk(self, outputs: Sequence[RequestOutput]) -> str | None:
        if not (self.include_usage and outputs):
            return None
        usage = make_usage(outputs, completion_tokens=self.completion_tokens)
        return sse(dumps({**self.head, "choices": [], "usage": usage.model_dump()}))


def watch_stalls(ctx: ServingContext, streams: list[RequestStream]) -> None:
    """The stalled-reader policy (--max-unread-stream-tokens, --stalled-stream-timeout) on `streams`."""
    limits = ctx.limits
    if limits.max_unread_stream_tokens > 0:
        policy = StallPolicy(limits.max_unread_stream_tokens, limits.stalled_stream_timeout)
        for s in streams:
            s.watch_unread(policy)


async def sse_body(ctx: ServingContext, streams: Sequence[RequestStream], chunks: AsyncIterator[str]) -> AsyncIterator[str]:
    """Frame `chunks` as an SSE stream: `[DONE]` after the last one, an error event first
    if the engine fails mid-stream, and the requests aborted however the stream ends --
    normally, on error, or when the client disconnects and the generator is closed.

    A client that stops reading blocks this generator at its send; its requests are then
    paused and, after --stalled-stream-timeout, aborted (`StallPolicy`, engine/async_engine.py)."""
    watch_stalls(ctx, streams)
    try:
        async with contextlib.aclosing(chunks):
            async for c in chunks:
                yield c
        yield SSE_DONE
    except (EngineDeadError, RequestFailedError) as e:
        yield sse_error(engine_failure(e))
        yield SSE_DONE
    finally:
        abort_all(ctx, streams)  # stop the work, free the KV blocks
