"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an engine core process.

``tinyvllm serve [engine flags] [--host H --port P --served-model-name NAME
--max-waiting-requests N --log-level L]``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(JSON or SSE streaming), ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /version``, ``POST /reset_prefix_cache``.
Errors always have OpenAI's shape ``{"error": {"message", "type", "param", "code"}}``.

Start-up (:func:`tinyvllm.entrypoints.openai.launcher.run_server`) spawns the engine core before
this module is imported, so its imports overlap the model load.

Shutdown (SIGINT / SIGTERM): in-flight requests end at once (streams with an
error event and ``data: [DONE]``), uvicorn closes its connections, then the
engine core process is told to exit and is joined (terminated, then killed, if
it does not). The core process also exits by itself if this process dies.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinyvllm
from tinyvllm.engine.async_llm import AsyncLLM, EngineStartCancelled, EngineStartError
from tinyvllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest)
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tinyvllm.entrypoints.openai.serving_engine import error_body, error_response
from tinyvllm.entrypoints.openai.serving_models import OpenAIServingModels
from tinyvllm.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from tinyvllm.metrics.prometheus import CONTENT_TYPE

logger = logging.getLogger("tinyvllm.api_server")


# ----------------------------------------------------------------------------- app


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"malformed JSON body: {ctx.get('error', err.get('msg', 'invalid JSON'))}", None
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        parts.append(f"{where}: {err.get('msg')}" if where else str(err.get("msg")))
    return "invalid request: " + "; ".join(parts[:5]), param


def build_app(engine: AsyncLLM, served_model_names: list[str] | None = None, chat_template: str | None = None,
              tool_call_parser: str | None = None) -> FastAPI:
    """The FastAPI application over a started :class:`AsyncLLM` (``chat_template``: Jinja text that
    replaces the model's; ``tool_call_parser``: the model's tool-call format, ``hermes``)."""
    app = FastAPI(title="tinyvllm", version=tinyvllm.__version__, docs_url=None, redoc_url=None)
    serving_models = OpenAIServingModels(engine, served_model_names)
    completion = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names, chat_template, tool_call_parser)
    tokenization = OpenAIServingTokenization(engine, served_model_names)
    app.state.engine = engine

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path, exc_info=exc)
        return error_response(f"internal server error: {type(exc).__name__}", 500)

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body("the engine core is not running", 503), status_code=503)
        return JSONResponse({"status": "ok", "engine_core_pid": engine.engine_pid})

    @app.get("/version")
    async def version() -> dict:
        return {"version": tinyvllm.__version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models() -> dict:
        return serving_models.list_models()

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Response:
        return await completion.create_completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Response:
        return await chat.create_chat_completion(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        return await tokenization.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        return await tokenization.detokenize(req)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        engine.reset_prefix_cache()
        return Response(status_code=200)

    return app


# ----------------------------------------------------------------------------- server


class _Server(uvicorn.Server):
    """uvicorn server that, on SIGINT/SIGTERM, first ends the engine's in-flight requests so that
    streaming responses finish (with an error event) instead of holding the graceful shutdown."""

    def __init__(self, config: uvicorn.Config, engine: AsyncLLM) -> None:
        super().__init__(config)
        self._engine = engine
        self._loop = asyncio.get_running_loop()

    def handle_exit(self, sig: int, frame: Any) -> None:
        if not self.should_exit:
            logger.info("received signal %d: shutting down", sig)
            self._loop.call_soon_threadsafe(self._engine.begin_shutdown)
        super().handle_exit(sig, frame)


async def _serve(args: argparse.Namespace, engine: AsyncLLM, served: list[str] | None, signals: list[int]) -> int:
    try:
        try:
            await engine.start(should_cancel=lambda: bool(signals))
        except EngineStartCancelled:
            logger.info("interrupted during start-up")
            return 0
        except EngineStartError as e:
            logger.error("%s", e)
            return 1
        template_path = getattr(args, "chat_template", None)
        template = Path(template_path).read_text() if template_path else None
        app = build_app(engine, served, template, getattr(args, "tool_call_parser", None))
        level = args.log_level.lower()
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=level, access_log=level == "debug",
                                timeout_graceful_shutdown=5, timeout_keep_alive=5, lifespan="off")
        server = _Server(config, engine)
        died: list[BaseException] = []

        def on_dead(err: BaseException) -> None:  # a dead engine cannot recover: exit (non-zero)
            logger.error("engine core died (%s); shutting down the server", err)
            died.append(err)
            server.should_exit = True

        engine.on_dead = on_dead
        logger.info("serving %s on http://%s:%d (engine core pid %d)", engine.model_name, args.host, args.port,
                    engine.engine_pid)
        await server.serve()
        return 0 if server.started and not died else 1
    finally:
        await engine.shutdown()
