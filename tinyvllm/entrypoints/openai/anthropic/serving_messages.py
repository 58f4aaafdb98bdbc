"""``POST /v1/messages`` and ``/v1/messages/count_tokens``: Anthropic's Messages API as a translation layer onto
the chat path (:class:`OpenAIServingChat`: the same chat template, sampling params, grammar-constrained tool
calls, Hermes tool-call parser and usage). Errors have Anthropic's shape
``{"type": "error", "error": {"type", "message"}}``; streams use Anthropic's named SSE events."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tinyvllm.engine.async_llm import RequestStream
from tinyvllm.entrypoints.openai.anthropic.protocol import CountTokensRequest, MessagesRequest
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.entrypoints.openai.serving_engine import (REQUEST_ERRORS, cached_of, collect, json_encoder,
                                                        run_until_disconnect, status_of)
from tinyvllm.entrypoints.openai.tool_calls import StreamingToolCallParser

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 405: "invalid_request_error", 413: "request_too_large",
                422: "invalid_request_error", 429: "rate_limit_error", 500: "api_error", 503: "overloaded_error"}


def anthropic_error_body(message: str, status: int) -> dict:
    return {"type": "error", "error": {"type": _ERROR_TYPES.get(status, "api_error"), "message": message}}


def anthropic_error(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse(anthropic_error_body(message, status), status_code=status)


def _exception_error(e: BaseException) -> JSONResponse:
    return anthropic_error(str(e) or type(e).__name__, status_of(e))


def _validation_text(e: ValidationError) -> str:
    """A 400 message for the translated chat request failing validation (naming the chat field)."""
    err = e.errors()[0]
    where = ".".join(str(x) for x in err.get("loc", ()))
    return f"invalid request: {where + ': ' if where else ''}{err.get('msg')}"


def _event(name: str, obj: dict) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json_encoder.encode(obj) + b"\n\n"


def _tool_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _stop_reason(finish: str | None, stop: Any, tool_calls: bool) -> tuple[str, str | None]:
    """Anthropic's ``stop_reason`` and ``stop_sequence`` from the engine's finish reason."""
    if finish == "length":
        return "max_tokens", None
    if tool_calls:
        return "tool_use", None
    if isinstance(stop, str):
        return "stop_sequence", stop
    return "end_turn", None


class AnthropicServingMessages:
    """The Messages endpoints, over the chat endpoint's internals."""

    def __init__(self, chat: OpenAIServingChat) -> None:
        self.chat = chat

    def _usage(self, prompt_tokens: int, output_tokens: int, cached: int) -> dict:
        # As Anthropic counts: input_tokens are the prompt tokens not read from the (prefix) cache
        return {"input_tokens": prompt_tokens - int(cached), "output_tokens": output_tokens,
                "cache_read_input_tokens": int(cached), "cache_creation_input_tokens": 0}

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        if self.chat.check_model(req.model) is not None:
            return anthropic_error(f"model: the model `{req.model}` does not exist", 404)
        try:
            chat_req = req.to_chat_request()
            _, ids, _ = await self.chat.chat_prompt(chat_req)
        except ValidationError as e:
            return anthropic_error(_validation_text(e), 400)
        except REQUEST_ERRORS as e:
            return _exception_error(e)
        return JSONResponse({"input_tokens": len(ids)})

    async def create_message(self, req: MessagesRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        if self.chat.check_model(req.model) is not None:
            return anthropic_error(f"model: the model `{req.model}` does not exist", 404)
        try:
            chat_req = req.to_chat_request()
            params, ids, streams, request_id, use_tools = await self.chat.prepare_chat(chat_req, arrival, "msg_")
        except ValidationError as e:
            return anthropic_error(_validation_text(e), 400)
        except REQUEST_ERRORS as e:
            return _exception_error(e)
        model = req.model or self.chat.model_name
        if req.stream:
            return StreamingResponse(self._stream(ids, streams[0], request_id, model, use_tools),
                                     media_type="text/event-stream")
        return await run_until_disconnect(raw, self._full(ids, streams[0], request_id, model, use_tools),
                                          streams[0].abort)

    async def _full(self, ids: list[int], stream: RequestStream, request_id: str, model: str,
                    use_tools: bool) -> Response:
        try:
            choices, cached = await collect([stream], 1)
        except REQUEST_ERRORS as e:
            return _exception_error(e)
        ch = choices[0]
        text, calls = (self.chat.tool_parser().extract(ch.text) if use_tools else (ch.text, []))
        content: list[dict] = []
        if text:
            content.append({"type": "text", "text": text})
        for c in calls:
            content.append({"type": "tool_use", "id": _tool_id(c.id), "name": c.name,
                            "input": json.loads(c.arguments)})
        stop_reason, stop_sequence = _stop_reason(ch.finish_reason, ch.stop_reason, bool(calls))
        body = {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence,
                "usage": self._usage(len(ids), len(ch.token_ids), cached)}
        return Response(json_encoder.encode(body), media_type="application/json")

    async def _stream(self, ids: list[int], stream: RequestStream, request_id: str, model: str,
                      use_tools: bool) -> AsyncIterator[bytes]:
        parser = StreamingToolCallParser(self.chat.tool_parser()) if use_tools else None
        output_tokens = 0
        started = False
        index = 0  # of the next content block
        text_open = False
        finish: str | None = None
        stop: Any = None

        def start(cached: int) -> bytes:
            msg = {"id": request_id, "type": "message", "role": "assistant", "model": model, "content": [],
                   "stop_reason": None, "stop_sequence": None, "usage": self._usage(len(ids), 0, cached)}
            return _event("message_start", {"type": "message_start", "message": msg}) + \
                _event("ping", {"type": "ping"})

        try:
            async for out in stream:
                if not started:
                    started = True
                    yield start(cached_of(out))
                for c in out.outputs:
                    output_tokens += len(c.token_ids)
                    text, call_chunks = c.text, []
                    if parser is not None:
                        text, call_chunks = parser.feed(c.text, final=c.finish_reason is not None)
                    if text:
                        if not text_open:
                            yield _event("content_block_start", {"type": "content_block_start", "index": index,
                                                                 "content_block": {"type": "text", "text": ""}})
                            text_open = True
                        yield _event("content_block_delta", {"type": "content_block_delta", "index": index,
                                                             "delta": {"type": "text_delta", "text": text}})
                    for chunk in call_chunks:
                        for item in chunk:
                            if "id" in item:  # a call begins: id and name (its arguments follow)
                                if text_open:
                                    yield _event("content_block_stop", {"type": "content_block_stop",
                                                                        "index": index})
                                    index += 1
                                    text_open = False
                                yield _event("content_block_start", {
                                    "type": "content_block_start", "index": index,
                                    "content_block": {"type": "tool_use", "id": _tool_id(item["id"]),
                                                      "name": item["function"]["name"], "input": {}}})
                            else:  # the whole arguments: the call is complete
                                yield _event("content_block_delta", {
                                    "type": "content_block_delta", "index": index,
                                    "delta": {"type": "input_json_delta",
                                              "partial_json": item["function"]["arguments"]}})
                                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
                                index += 1
                    if c.finish_reason is not None:
                        finish, stop = c.finish_reason, c.stop_reason
            if not started:
                yield start(0)
            if text_open:
                yield _event("content_block_stop", {"type": "content_block_stop", "index": index})
            stop_reason, stop_sequence = _stop_reason(finish, stop, bool(parser and parser.num_calls))
            yield _event("message_delta", {"type": "message_delta",
                                           "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                           "usage": {"output_tokens": output_tokens}})
            yield _event("message_stop", {"type": "message_stop"})
        except REQUEST_ERRORS as e:
            yield _event("error", anthropic_error_body(str(e), status_of(e)))
        except Exception as e:  # noqa: BLE001 - the stream has started: end it with an error event
            yield _event("error", anthropic_error_body(
                f"internal server error ({type(e).__name__}); request id {request_id}", 500))
        finally:
            stream.abort()
