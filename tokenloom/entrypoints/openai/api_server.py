"""The OpenAI-compatible HTTP server: FastAPI routes around one AsyncLLMEngine.

    /v1/completions, /v1/chat/completions   generation (JSON or SSE)      [--api-key applies]
    /v1/responses (+ GET/DELETE /{id})      the Responses API (serving_responses.py) [--api-key applies]
    /v1/embeddings                          embeddings (--runner pooling) [--api-key applies]
    /v1/models, /v1/models/{id}             what is served (LoRA adapters too) [--api-key applies]
    /v1/load_lora_adapter, /v1/unload_lora_adapter   LoRA adapters at run time (--enable-lora) [--api-key applies]
    /tokenize /detokenize /tokenizer_info   the model's tokenizer over HTTP [--api-key applies]
    /health /version /metrics               liveness, version, Prometheus
    /dashboard, /dashboard/events           the live step picture (--api-key applies; --no-dashboard)

Every error is OpenAI-shaped JSON, and the OpenAPI document (/openapi.json) says so: each
route lists the error statuses it can answer, and SSE / Prometheus / plain-text bodies are
declared with their real content types, so generated clients and schema fuzzers can trust it.

A server runs one kind of engine (`--runner`): generate serves the generation routes,
pooling the embeddings route; the other kind's routes answer 400 saying which runner they
need, and are left out of the OpenAPI document (which lists what this server serves).

Lifecycle: the engine (weights, KV cache) is built before uvicorn binds its port, so a
successful /health means "ready to generate".  The engine thread starts with the app
(lifespan startup) and is stopped, after in-flight requests were finished or aborted, on
lifespan shutdown -- which uvicorn runs on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenloom.version import __version__
from tokenloom.router.server import CleanExitServer
from tokenloom.config import EngineArgs
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.openai.auth import bearer_matches
from tokenloom.entrypoints.openai.errors import bad_request, error_body, install_error_handlers
from tokenloom.entrypoints.openai.body_limit import BodySizeLimitMiddleware
from tokenloom.entrypoints.openai.dashboard_routes import install_dashboard
from tokenloom.entrypoints.openai.limits import ServerLimits
from tokenloom.entrypoints.openai.openapi_limits import ServerFacts
from tokenloom.entrypoints.openai.model_names import default_served_names
from tokenloom.entrypoints.openai.lora_models import parse_lora_modules
from tokenloom.entrypoints.openai.openapi_doc import (GENERATION_ERRORS, LORA_LOAD_ERRORS, LORA_UNLOAD_ERRORS,
                                                      LORA_WHY, TOKENIZER_ERRORS, describe_api_key, error_responses,
                                                      generation_ok, install_openapi)
from tokenloom.entrypoints.openai.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                                   CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                                   EmbeddingRequest, EmbeddingResponse, LoadLoRAAdapterRequest,
                                                   ModelCard, ModelList, TokenizeRequest, TokenizeResponse,
                                                   TokenizerInfo, UnloadLoRAAdapterRequest)
from tokenloom.entrypoints.openai.serving_chat import create_chat_completion, render_messages
from tokenloom.entrypoints.openai.serving_common import ServingContext, encode_text, off_loop, tokenize_limit
from tokenloom.entrypoints.openai.serving_completion import create_completion
from tokenloom.entrypoints.openai.serving_embedding import create_embedding
from tokenloom.entrypoints.openai.serving_responses import install_responses
from tokenloom.entrypoints.openai.unsent_bound import with_unsent_bound

logger = logging.getLogger("tokenloom.server")


GUARDED_PREFIXES = ("/v1", "/tokenize", "/detokenize", "/tokenizer_info")


def is_guarded(path: str) -> bool:
    """Whether --api-key applies to `path`: the API and the tokenizer, not liveness or metrics."""
    return path.startswith(GUARDED_PREFIXES)


class APIKeyMiddleware:
    """401 for any guarded request (`is_guarded`) without `Authorization: Bearer <key>`.

    Plain ASGI (not a FastAPI dependency) so the key is checked before the body is read:
    an unauthenticated client learns nothing, not even that its JSON was malformed, and
    cannot make the server buffer a large body."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.api_key = api_key

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and is_guarded(scope["path"]) and scope["method"] != "OPTIONS":
            if not bearer_matches(dict(scope["headers"]).get(b"authorization", b""), self.api_key):
                resp = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                               "authentication_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def server_facts(ctx: ServingContext) -> ServerFacts:
    """This server's limits, for its OpenAPI document."""
    engine, limits = ctx.engine, ctx.limits
    return ServerFacts(vocab_size=engine.engine.vocab_size, max_model_len=engine.max_model_len, max_n=limits.max_n,
                       max_stop_strings=limits.max_stop_strings, max_stop_string_chars=limits.max_stop_string_chars,
                       max_prompts_per_request=limits.max_prompts_per_request, max_logit_bias=limits.max_logit_bias,
                       tokenize_limit=tokenize_limit(ctx),
                       trust_request_chat_template=limits.trust_request_chat_template,
                       empty_text_has_tokens=bool(engine.tokenizer.encode("", add_special_tokens=True)),
                       **_pooling_facts(engine.engine.pooling_config))


def _pooling_facts(pooling) -> dict:
    """An embedding server's vector length and what `dimensions` may ask (none for a generator)."""
    if pooling is None:
        return {}
    return dict(embedding_size=pooling.dimensions, matryoshka=pooling.is_matryoshka,
                matryoshka_dimensions=pooling.matryoshka_dimensions)


def build_app(ctx: ServingContext, *, api_key: str | None = None, dashboard: bool = True) -> FastAPI:
    engine = ctx.engine
    hub = None

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        logger.info("serving %s (max_model_len %d)", ", ".join(ctx.served_model_names), engine.max_model_len)
        try:
            yield
        finally:
            if hub is not None:
                hub.close()
            # join() blocks; run it off the loop so uvicorn can finish closing connections.
            await asyncio.to_thread(engine.shutdown)
            await asyncio.to_thread(ctx.close)  # the grammar compile workers

    app = FastAPI(title="tokenloom", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    # Starlette runs the middleware added last first: the key is checked before a body is read.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=ctx.limits.max_request_body_bytes)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    guarded = describe_api_key(bool(api_key))

    @app.get("/health", response_class=PlainTextResponse, responses=error_responses(503))
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(engine.dead_reason or "the engine is not running",
                                           "service_unavailable_error", None, "engine_unavailable"), status_code=503)
        return PlainTextResponse("")  # empty, but typed as the document says

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics", response_class=PlainTextResponse)
    async def metrics() -> Response:
        body = engine.metrics.render() if engine.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    def card(name: str) -> ModelCard:
        lora = ctx.loras.get(name)
        if lora is not None:  # an adapter: its own directory, the base model as parent
            return ModelCard(id=name, created=ctx.created, root=lora.lora_path, parent=lora.base_model_name,
                             max_model_len=engine.max_model_len)
        return ModelCard(id=name, created=ctx.created, root=str(engine.engine.model_path),
                         max_model_len=engine.max_model_len)

    @app.get("/v1/models", response_model=ModelList, responses=error_responses(*guarded))
    async def models() -> ModelList:
        """The base model's names, then each LoRA adapter (with the base model as `parent`)."""
        return ModelList(data=[card(name) for name in [*ctx.served_model_names, *ctx.loras.by_name]])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=error_responses(*guarded, 404))
    async def model(model_id: str) -> ModelCard:
        """One served model or adapter (the openai client's `models.retrieve`); 404 for any other name."""
        if model_id not in ctx.served_model_names:
            ctx.check_model(model_id)  # raises the OpenAI-shaped 404 unless it names an adapter
        return card(model_id)

    if ctx.loras.enabled:
        @app.post("/v1/load_lora_adapter", response_class=PlainTextResponse,
                  responses=error_responses(*guarded, *LORA_LOAD_ERRORS, why=LORA_WHY))
        async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> Response:
            """Serve the peft adapter at `lora_path` (a directory on the server) as `lora_name`."""
            lora = await ctx.loras.load(body.lora_name, body.lora_path)
            logger.info("LoRA adapter %r loaded from %s", lora.lora_name, lora.lora_path)
            return PlainTextResponse(f"Success: LoRA adapter {lora.lora_name!r} added successfully.")

        @app.post("/v1/unload_lora_adapter", response_class=PlainTextResponse,
                  responses=error_responses(*guarded, *LORA_UNLOAD_ERRORS, why=LORA_WHY))
        async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> Response:
            """Stop serving the adapter `lora_name` (requests running on it finish first)."""
            lora = ctx.loras.unload(body.lora_name)
            logger.info("LoRA adapter %r unloaded", lora.lora_name)
            return PlainTextResponse(f"Success: LoRA adapter {lora.lora_name!r} removed successfully.")

    runner = engine.engine.runner_type
    generating, pooling = runner == "generate", runner == "pooling"

    def needs(kind: str, route: str) -> None:
        if runner != kind:
            raise bad_request(f"{route} is not served here: this server runs --runner {runner}; start it with "
                              f"--runner {kind}", code="unsupported_route")

    @app.post("/v1/completions", responses=generation_ok(CompletionResponse, *guarded, *GENERATION_ERRORS),
              include_in_schema=generating)
    async def completions(body: CompletionRequest, raw: Request):
        needs("generate", "/v1/completions")
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions",
              responses=generation_ok(ChatCompletionResponse, *guarded, *GENERATION_ERRORS),
              include_in_schema=generating)
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        needs("generate", "/v1/chat/completions")
        return await create_chat_completion(ctx, body, raw)

    @app.post("/v1/embeddings", response_model=EmbeddingResponse,
              responses=error_responses(*guarded, *GENERATION_ERRORS), include_in_schema=pooling)
    async def embeddings(body: EmbeddingRequest, raw: Request) -> Response:
        needs("pooling", "/v1/embeddings")
        return await create_embedding(ctx, body, raw)

    @app.post("/tokenize", response_model=TokenizeResponse, responses=error_responses(*guarded, *TOKENIZER_ERRORS))
    async def tokenize(body: TokenizeRequest) -> Response:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")

        def work() -> bytes:  # templating, tokenizing and the (possibly long) JSON: all off the loop
            # Bounded by --max-tokenize-tokens (serving_common.encode_text), not max_model_len:
            # like vLLM's, this route counts texts longer than the context.
            if body.messages is not None:
                ids = render_messages(ctx, body.messages, chat_template=body.chat_template,
                                      add_generation_prompt=body.add_generation_prompt, route="tokenize")
            else:
                ids = encode_text(ctx, body.prompt, add_special_tokens=body.add_special_tokens, param="prompt",
                                  route="tokenize")
            return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids,
                                    token_strs=engine.tokenizer.convert_ids_to_tokens(ids)).model_dump_json().encode()

        return Response(await off_loop(work), media_type="application/json")

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=error_responses(*guarded, *TOKENIZER_ERRORS))
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        ctx.check_model(body.model)

        limit = tokenize_limit(ctx)  # what /tokenize can give, /detokenize takes back
        if len(body.tokens) > limit:
            raise bad_request(f"at most {limit} token ids can be decoded at once (--max-tokenize-tokens, or "
                              f"max_model_len if larger), got {len(body.tokens)}", param="tokens", code="limit_exceeded")

        def work() -> DetokenizeResponse:
            vocab = engine.engine.vocab_size
            bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise bad_request(f"token id {bad} is out of range for a vocabulary of {vocab}", param="tokens")
            return DetokenizeResponse(prompt=engine.tokenizer.decode(body.tokens))

        return await off_loop(work)

    @app.get("/tokenizer_info", response_model=TokenizerInfo, responses=error_responses(*guarded))
    async def tokenizer_info() -> TokenizerInfo:
        """The tokenizer's settings (vLLM's endpoint, read by lm-eval-harness's remote tokenizer)."""
        return TokenizerInfo.of(engine.tokenizer, engine.max_model_len, engine.engine.vocab_size)

    if generating:  # /v1/responses: the Responses API over the chat path (a pooling server has none)
        install_responses(app, ctx, guarded)

    if dashboard:  # checks the key itself: ?key= and a cookie count there, not only the header
        hub = install_dashboard(app, engine.engine, ctx.served_model_names, api_key)
    app.state.dashboard = hub
    install_openapi(app, server_facts(ctx))

    return app


class _Server(CleanExitServer):
    """uvicorn with two changes to its shutdown.

    - In-flight requests get `grace` seconds to finish; then the engine aborts them, so each
      stream ends with an error chunk and `[DONE]` (and each plain request with a 503) instead
      of uvicorn cancelling the handler mid-write and cutting the connection.  uvicorn's own
      timeout stays as a backstop, a little later.
    - uvicorn re-raises the signal it caught once it is done, so SIGTERM would end the process
      with -15 and SIGINT with a KeyboardInterrupt; we promise exit status 0 after a clean
      stop, so the handlers are installed and simply restored (`CleanExitServer`).
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float, *,
                 exit_on_engine_failure: bool = True):
        super().__init__(config)
        self.engine = engine
        self.grace = grace
        self.exit_on_engine_failure = exit_on_engine_failure
        self.engine_failed: str | None = None  # why the engine died, if it did: exit status 1

    def engine_died(self, reason: str) -> None:
        """The engine gave up (failed steps in a row, broken device); every client has its
        error already.  /health answers 503 from now on, and unless told otherwise the
        server stops so the process exits non-zero and a supervisor restarts it.  Called on
        the engine thread: uvicorn's main loop polls `should_exit`."""
        self.engine_failed = reason
        if self.exit_on_engine_failure:
            logger.error("engine dead (%s); shutting the server down", reason)
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        hub = getattr(self.config.app.state, "dashboard", None) if hasattr(self.config.app, "state") else None
        if hub is not None:  # dashboard streams never end by themselves: end them, or uvicorn waits
            hub.close()
        timer = asyncio.get_running_loop().call_later(
            self.grace, self.engine.abort_all, f"the server is shutting down (in-flight requests get {self.grace:g}s)")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def build_server(args: argparse.Namespace) -> tuple[_Server, AsyncLLMEngine]:
    """Load the model and build (but do not start) the uvicorn server for parsed `serve` args."""
    limits = ServerLimits.from_cli_args(args)
    engine_args = EngineArgs.from_cli_args(args)
    lora_modules = parse_lora_modules(getattr(args, "lora_modules", None))  # a bad flag fails before loading
    if lora_modules and not engine_args.enable_lora:
        raise ValueError("--lora-modules needs --enable-lora")
    engine = AsyncLLMEngine.from_engine_args(engine_args, max_failed_steps=getattr(args, "max_failed_steps", 3))
    # One encode now settles the fast tokenizer's truncation/padding state, so the worker
    # threads that tokenize requests concurrently never need to change it (which would fail
    # with "Already borrowed" while another thread is encoding).
    engine.tokenizer.encode("warm-up")
    if args.served_model_name:
        names, aliases = list(args.served_model_name), []
    else:  # a path is served under its directory's name, and still accepted as given
        names, aliases = default_served_names(args.model, engine.model_name)
    ctx = ServingContext(engine, names, limits, tool_call_parser=getattr(args, "tool_call_parser", None),
                         model_aliases=aliases, reasoning_parser=getattr(args, "reasoning_parser", None),
                         max_stored_responses=getattr(args, "max_stored_responses", 1024))
    for name, path in lora_modules:
        ctx.loras.load_now(name, path)
    app = build_app(ctx, api_key=args.api_key, dashboard=getattr(args, "dashboard", True))
    grace = max(0.0, args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.disable_access_log,
                            timeout_graceful_shutdown=grace + 5.0)  # backstop; see _Server
    config.load()  # resolves the HTTP protocol class, which bounds what a stalled client absorbs:
    config.http_protocol_class = with_unsent_bound(config.http_protocol_class, limits.max_unsent_bytes)
    server = _Server(config, engine, grace, exit_on_engine_failure=getattr(args, "exit_on_engine_failure", True))
    engine.on_dead = server.engine_died
    return server, engine
