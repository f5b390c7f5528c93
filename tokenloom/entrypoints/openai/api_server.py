"""The OpenAI-compatible HTTP server: FastAPI routes around one AsyncLLMEngine.

    /v1/completions, /v1/chat/completions   generation (JSON or SSE)      [--api-key applies]
    /v1/models                              what is served                [--api-key applies]
    /health /version /metrics               liveness, version, Prometheus
    /tokenize /detokenize                   the model's tokenizer over HTTP

Lifecycle: the engine (weights, KV cache) is built before uvicorn binds its port, so a
successful /health means "ready to generate".  The engine thread starts with the app
(lifespan startup) and is stopped, after in-flight requests were finished or aborted, on
lifespan shutdown -- which uvicorn runs on SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hmac
import logging
import signal
import threading
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from tokenloom import __version__
from tokenloom.config import EngineArgs
from tokenloom.engine.async_engine import AsyncLLMEngine
from tokenloom.entrypoints.openai.errors import bad_request, error_body, install_error_handlers
from tokenloom.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                   ModelCard, ModelList, TokenizeRequest)
from tokenloom.entrypoints.openai.serving_chat import create_chat_completion, render_messages
from tokenloom.entrypoints.openai.serving_common import ServingContext
from tokenloom.entrypoints.openai.serving_completion import create_completion

logger = logging.getLogger("tokenloom.server")


class APIKeyMiddleware:
    """401 for any /v1 request without `Authorization: Bearer <key>`.

    Plain ASGI (not a FastAPI dependency) so the key is checked before the body is parsed:
    an unauthenticated client learns nothing, not even that its JSON was malformed."""

    def __init__(self, app: Any, api_key: str):
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            got = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(got, self.expected):  # constant time: no guessing by timing
                resp = JSONResponse(error_body("invalid or missing API key (send 'Authorization: Bearer <key>')",
                                               "authentication_error", None, "invalid_api_key"),
                                    status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await resp(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(ctx: ServingContext, *, api_key: str | None = None) -> FastAPI:
    engine = ctx.engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start(asyncio.get_running_loop())
        logger.info("serving %s (max_model_len %d)", ", ".join(ctx.served_model_names), engine.max_model_len)
        try:
            yield
        finally:
            # join() blocks; run it off the loop so uvicorn can finish closing connections.
            await asyncio.to_thread(engine.shutdown)

    app = FastAPI(title="tokenloom", version=__version__, lifespan=lifespan)
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body(engine.dead_reason or "the engine is not running",
                                           "service_unavailable_error", None, "engine_unavailable"), status_code=503)
        return Response(status_code=200)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        body = engine.metrics.render() if engine.metrics is not None else b""
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> dict:
        root = str(engine.engine.model_path)
        cards = [ModelCard(id=name, created=ctx.created, root=root, max_model_len=engine.max_model_len)
                 for name in ctx.served_model_names]
        return ModelList(data=cards).model_dump(mode="json")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request):
        return await create_completion(ctx, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request):
        return await create_chat_completion(ctx, body, raw)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ctx.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of 'prompt' or 'messages'", param="prompt")
        if body.messages is not None:
            ids = render_messages(ctx, body.messages, chat_template=body.chat_template,
                                  add_generation_prompt=body.add_generation_prompt)
        else:
            ids = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": engine.tokenizer.convert_ids_to_tokens(ids)}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        ctx.check_model(body.model)
        vocab = engine.engine.vocab_size
        bad = next((t for t in body.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range for a vocabulary of {vocab}", param="tokens")
        return {"prompt": engine.tokenizer.decode(body.tokens)}

    return app


class _Server(uvicorn.Server):
    """uvicorn with two changes to its shutdown.

    - In-flight requests get `grace` seconds to finish; then the engine aborts them, so each
      stream ends with an error chunk and `[DONE]` (and each plain request with a 503) instead
      of uvicorn cancelling the handler mid-write and cutting the connection.  uvicorn's own
      timeout stays as a backstop, a little later.
    - uvicorn re-raises the signal it caught once it is done, so SIGTERM would end the process
      with -15 and SIGINT with a KeyboardInterrupt; we promise exit status 0 after a clean
      stop, so the handlers are installed and simply restored.
    """

    def __init__(self, config: uvicorn.Config, engine: AsyncLLMEngine, grace: float):
        super().__init__(config)
        self.engine = engine
        self.grace = grace

    async def shutdown(self, sockets=None) -> None:
        timer = asyncio.get_running_loop().call_later(
            self.grace, self.engine.abort_all, f"the server is shutting down (in-flight requests get {self.grace:g}s)")
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()

    @contextlib.contextmanager
    def capture_signals(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread (tests run servers in threads)
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def build_server(args: argparse.Namespace) -> tuple[_Server, AsyncLLMEngine]:
    """Load the model and build (but do not start) the uvicorn server for parsed `serve` args."""
    if args.max_queued_requests is not None and args.max_queued_requests < 0:
        raise ValueError("--max-queued-requests must be >= 0")
    engine_args = EngineArgs.from_cli_args(args)
    engine = AsyncLLMEngine.from_engine_args(engine_args)
    names = args.served_model_name or [engine.model_name]
    ctx = ServingContext(engine, names, args.max_queued_requests)
    app = build_app(ctx, api_key=args.api_key)
    grace = max(0.0, args.shutdown_timeout)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            access_log=not args.disable_access_log,
                            timeout_graceful_shutdown=grace + 5.0)  # backstop; see _Server
    return _Server(config, engine, grace), engine
