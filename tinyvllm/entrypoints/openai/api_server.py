"""The OpenAI-compatible HTTP server (FastAPI + uvicorn) in front of an engine core process.

``tinyvllm serve [engine flags] [--host H --port P --served-model-name NAME
--max-waiting-requests N --log-level L]``.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(JSON or SSE streaming), ``POST /v1/messages`` and ``/v1/messages/count_tokens`` (Anthropic's Messages API,
errors in Anthropic's shape), ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``,
``POST /v1/responses/{id}/cancel`` (OpenAI's Responses API, stored in SQLite), ``POST /tokenize``, ``POST /detokenize``, ``GET /health``,
``GET /metrics`` (Prometheus), ``GET /version``, ``POST /reset_prefix_cache``, ``GET /dashboard`` (live
engine dashboard, :mod:`tinyvllm.entrypoints.dashboard`).
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
import os
import socket
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import tinyvllm
from tinyvllm import envs
from tinyvllm.engine.async_llm import AsyncLLM, EngineStartCancelled, EngineStartError
from tinyvllm.entrypoints.dashboard import add_dashboard_routes
from tinyvllm.entrypoints.openai.anthropic.protocol import CountTokensRequest, MessagesRequest
from tinyvllm.entrypoints.openai.anthropic.serving_messages import (MESSAGES_PATHS, AnthropicServingMessages,
                                                                    anthropic_error)
from tinyvllm.entrypoints.openai.middleware import APIKeyMiddleware, GuardMiddleware
from tinyvllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest, json_type)
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from tinyvllm.entrypoints.openai.serving_engine import error_body, error_response
from tinyvllm.entrypoints.openai.serving_models import OpenAIServingModels
from tinyvllm.entrypoints.openai.responses_protocol import ResponsesRequest
from tinyvllm.entrypoints.openai.serving_responses import OpenAIServingResponses, StoreConfig
from tinyvllm.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from tinyvllm.metrics.prometheus import CONTENT_TYPE, kv_cache_dtype_label

logger = logging.getLogger("tinyvllm.api_server")


# ----------------------------------------------------------------------------- app


# pydantic's error types for a value of the wrong JSON type (the request models are strict: nothing is coerced)
_STRICT_TYPES = {"bool_type", "int_type", "float_type", "string_type", "list_type", "dict_type", "model_type"}


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
    parts, param = [], None
    for err in errors:
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            ctx = err.get("ctx") or {}
            return f"malformed JSON body: {ctx.get('error', err.get('msg', 'invalid JSON'))}", None
        if err.get("type") == "unencodable_text":  # raised for the whole body; the field is in ctx
            field = str((err.get("ctx") or {}).get("field", ""))
            return str(err.get("msg")), field.split(".", 1)[0].split("[", 1)[0] or None
        where = ".".join(loc)
        if not where and err.get("type") == "missing":  # no body at all
            parts.append("the request body is required (a JSON object)")
            continue
        if param is None and loc:
            param = loc[0]
        msg = str(err.get("msg"))
        if err.get("type") in _STRICT_TYPES:  # strict mode: say what was sent (e.g. a string for a boolean)
            msg += f", got {json_type(err.get('input'))}"
        parts.append(f"{where}: {msg}" if where else msg)
    return "invalid request: " + "; ".join(parts[:5]), param


DEFAULT_OPEN_PATHS = ("/health", "/metrics", "/version")


def build_app(engine: AsyncLLM, served_model_names: list[str] | None = None, chat_template: str | None = None,
              tool_call_parser: str | None = None, *, reasoning_parser: str | None = None,
              max_request_body_bytes: int | None = None,
              api_keys: list[str] | None = None, open_paths: list[str] | tuple[str, ...] = DEFAULT_OPEN_PATHS,
              allowed_origins: list[str] | None = None, responses_store: StoreConfig | None = None) -> FastAPI:
    """The FastAPI application over a started :class:`AsyncLLM`.

    Args:
        engine: the started engine.
        served_model_names: names the model answers to (default: the engine's).
        chat_template: Jinja text that replaces the model's chat template.
        tool_call_parser: the model's tool-call format (``hermes``, ``mistral``, ``pythonic``,
            ``llama3_json``, or ``auto``: from the chat template).
        reasoning_parser: ``qwen3`` (or ``deepseek_r1``): the thinking comes back as ``reasoning_content``.
        max_request_body_bytes: larger request bodies get 413 (None: no cap).
        api_keys: when given, every path but ``open_paths`` needs ``Authorization: Bearer <key>`` (401).
        open_paths: paths served without a key.
        allowed_origins: CORS origins (``["*"]`` for any); None or empty: no CORS headers.
        responses_store: where and how much ``/v1/responses`` stores (default: in memory, default bounds).
    """
    app = FastAPI(title="tinyvllm", version=tinyvllm.__version__, docs_url=None, redoc_url=None)
    # Added innermost first: CORS (outermost, so 401 / 413 / 500 answers carry its headers too), then the
    # guard (request id, body cap, unhandled errors), then the API key check.
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys, open_paths=open_paths)
    app.add_middleware(GuardMiddleware, max_body_bytes=max_request_body_bytes)
    if allowed_origins:
        app.add_middleware(CORSMiddleware, allow_origins=allowed_origins, allow_methods=["*"],
                           allow_headers=["*"], allow_credentials=False)
    serving_models = OpenAIServingModels(engine, served_model_names)
    completion = OpenAIServingCompletion(engine, served_model_names)
    chat = OpenAIServingChat(engine, served_model_names, chat_template, tool_call_parser, reasoning_parser)
    tokenization = OpenAIServingTokenization(engine, served_model_names)
    messages_api = AnthropicServingMessages(chat)
    responses_api = OpenAIServingResponses(chat, responses_store, auth_enabled=bool(api_keys))
    app.state.responses = responses_api
    app.state.engine = engine
    add_dashboard_routes(app, engine)  # GET /dashboard, /dashboard/events

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        if request.url.path in MESSAGES_PATHS:  # Anthropic's error shape
            return anthropic_error(message, 400)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if request.url.path in MESSAGES_PATHS:
            resp = anthropic_error(str(exc.detail), exc.status_code)
            resp.headers.update(getattr(exc, "headers", None) or {})
            return resp
        return JSONResponse(error_body(str(exc.detail), exc.status_code), status_code=exc.status_code,
                            headers=getattr(exc, "headers", None))

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse(error_body("the engine core is not running", 503), status_code=503)
        body: dict[str, Any] = {"status": "ok", "engine_core_pid": engine.engine_pid}
        if getattr(engine, "data_parallel_size", 1) > 1:
            body["engine_core_pids"] = engine.engine_pids
        return JSONResponse(body)

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

    @app.post("/v1/messages")
    async def messages(req: MessagesRequest, raw: Request) -> Response:
        """Anthropic's Messages API (translated onto the chat path)."""
        return await messages_api.create_message(req, raw)

    @app.post("/v1/messages/count_tokens")
    async def messages_count_tokens(req: CountTokensRequest) -> Response:
        return await messages_api.count_tokens(req)

    @app.post("/v1/responses")
    async def responses(req: ResponsesRequest, raw: Request) -> Response:
        """OpenAI's Responses API (translated onto the chat path; stored, continuable)."""
        return await responses_api.create(req, raw)

    @app.get("/v1/responses/{response_id}")
    async def responses_get(response_id: str, raw: Request) -> Response:
        return await responses_api.retrieve(response_id, raw)

    @app.delete("/v1/responses/{response_id}")
    async def responses_delete(response_id: str, raw: Request) -> Response:
        return await responses_api.delete(response_id, raw)

    @app.post("/v1/responses/{response_id}/cancel")
    async def responses_cancel(response_id: str, raw: Request) -> Response:
        return await responses_api.cancel(response_id, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest) -> Response:
        return await tokenization.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest) -> Response:
        return await tokenization.detokenize(req)

    @app.get("/debug/state")
    async def debug_state() -> dict:
        """Requests and KV blocks held by this process and the engine core (its last report)."""
        return engine.tracked_state()

    @app.get("/debug/stats")
    async def debug_stats() -> dict:
        """The engine core's last :class:`~tinyvllm.metrics.stats.SchedulerStats` (gauges and counters
        since start, e.g. ``decode_tokens``): what a test reads to prove an abort stopped the work. With
        ``--data-parallel-size`` > 1 these are summed over the replicas, and ``replicas`` holds each one's
        (with its pid and the router's counts: ``routed_requests``, ``predicted_hit_blocks``...)."""
        stats: dict[str, Any] = engine.stats.as_dict()
        if getattr(engine, "data_parallel_size", 1) > 1:
            stats["replicas"] = engine.replica_stats()
        return stats

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


def _bind(host: str, port: int, port_file: str | None = None) -> socket.socket:
    """The server's listening socket, bound here (as uvicorn binds it: ``SO_REUSEADDR``) so that port 0 can
    mean "any free port": the port the kernel chose is then written to ``port_file`` (atomically: the file
    appears complete or not at all), so a caller learns it without a bind-then-close race.
    Raises ``OSError`` (e.g. EADDRINUSE) if the address cannot be bound."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto=IPPROTO_TCP, not the default 0: asyncio sets TCP_NODELAY only on accepted sockets whose proto
    # is IPPROTO_TCP (``asyncio.base_events._set_nodelay``), and accepted sockets inherit this one's. Without
    # it Nagle's algorithm holds each response's second write until the client's delayed ACK (~40 ms on
    # Linux): every request on a kept-alive connection took >= 40 ms, and stream chunks could stall as long.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        if port_file:
            tmp = f"{port_file}.tmp{os.getpid()}"
            Path(tmp).write_text(f"{sock.getsockname()[1]}\n")
            os.replace(tmp, port_file)
    except BaseException:
        sock.close()
        raise
    return sock


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
        api_keys = args.api_key or ([envs.TINYVLLM_API_KEY] if envs.TINYVLLM_API_KEY else None)
        if isinstance(api_keys, str):
            api_keys = [api_keys]
        store_path = getattr(args, "responses_store_path", None) or str(envs.TINYVLLM_CACHE / "responses.sqlite")
        store = StoreConfig(store_path, getattr(args, "responses_store_max_count", 10_000),
                            getattr(args, "responses_store_max_bytes", 256 << 20),
                            getattr(args, "responses_store_ttl", 7 * 86400.0))
        template_path = getattr(args, "chat_template", None)
        template = Path(template_path).read_text() if template_path else None
        app = build_app(engine, served, template, getattr(args, "tool_call_parser", None),
                        reasoning_parser=getattr(args, "reasoning_parser", None),
                        max_request_body_bytes=args.max_request_body_bytes or None,
                        api_keys=api_keys, open_paths=args.open_paths,
                        allowed_origins=args.allowed_origins, responses_store=store)
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
        try:
            sock = _bind(args.host, args.port, getattr(args, "port_file", None))
        except OSError as e:
            logger.error("cannot listen on %s:%d: %s", args.host, args.port, e)
            return 1
        info = engine.engine_info
        dp = engine.data_parallel_size
        engine.metrics.set_cache_config(
            info.block_size, kv_cache_dtype_label(engine.config.cache_config.kv_cache_dtype, info.dtype or "?"),
            info.num_kv_blocks)
        logger.info("serving %s on http://%s:%d (%s, quantization %s, KV cache %d tokens%s, max_model_len %d; "
                    "engine core pid%s %s)", engine.model_name, args.host, sock.getsockname()[1], info.dtype or "?",
                    info.quantization or "?", info.num_kv_blocks * info.block_size,
                    f" x {dp} data-parallel replicas" if dp > 1 else "", engine.max_model_len,
                    "s" if dp > 1 else "", ", ".join(str(p) for p in engine.engine_pids))
        await server.serve(sockets=[sock])
        return 0 if server.started and not died else 1
    finally:
        await engine.shutdown()
