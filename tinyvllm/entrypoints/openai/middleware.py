"""ASGI middleware of the HTTP server: request-body cap, the one unhandled-exception handler, API keys.

Pure ASGI (no ``BaseHTTPMiddleware``), so streaming responses pass through untouched.

* :class:`GuardMiddleware` gives every request an id (its ``X-Request-Id`` header, else a new one), answers
  ``413`` when the body exceeds ``max_body_bytes`` (``Content-Length`` checked up front; a chunked body is
  counted as it arrives), and turns any exception a handler lets escape into one log line naming the request
  id and an OpenAI-style ``500`` body (on the Messages API's paths, 413 and 500 are in Anthropic's shape).
  Nothing is re-raised, so the server logs no second traceback and keeps
  the connection alive (Starlette's own ``Exception`` handler re-raises after answering).
* :class:`APIKeyMiddleware` requires ``Authorization: Bearer <key>`` (or ``x-api-key: <key>``) on every path except the open ones
  (``/health``, ``/metrics``, ``/version`` by default), compared in constant time (:func:`hmac.compare_digest`),
  and answers ``401`` with an OpenAI-style body otherwise, as vLLM's ``--api-key``.

CORS (``--allowed-origins``) is Starlette's ``CORSMiddleware``, added outside these two by the app builder.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import traceback
import uuid
from typing import Any, Awaitable, Callable, Iterable

import msgspec

logger = logging.getLogger("tinyvllm.api_server")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_encoder = msgspec.json.Encoder()
_TYPES = {401: "AuthenticationError", 413: "BadRequestError", 500: "InternalServerError"}


# Anthropic's error types (the Messages API's paths answer in Anthropic's shape)
_ANTHROPIC_TYPES = {401: "authentication_error", 413: "request_too_large", 500: "api_error"}


def _error_bytes(message: str, status: int, param: str | None = None, anthropic: bool = False) -> bytes:
    if anthropic:
        return _encoder.encode({"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(status, "api_error"),
                                                           "message": message}})
    return _encoder.encode({"error": {"message": message, "type": _TYPES.get(status, "Error"), "param": param,
                                      "code": status}})


def is_anthropic_path(scope: Scope) -> bool:
    """Whether the request is to Anthropic's Messages API (answered in Anthropic's error shape)."""
    return str(scope.get("path", "")).startswith("/v1/messages")


async def send_error(send: Send, message: str, status: int, headers: Iterable[tuple[bytes, bytes]] = (),
                     anthropic: bool = False) -> None:
    """Send a complete JSON error response with ``status``: ``{"error": {...}}`` (OpenAI's shape) or, with
    ``anthropic``, ``{"type": "error", "error": {"type", "message"}}``."""
    body = _error_bytes(message, status, anthropic=anthropic)
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyTooLarge(Exception):
    """Raised from ``receive`` once a request body grows past the cap."""


def _header(scope: Scope, name: bytes) -> bytes | None:
    for k, v in scope.get("headers") or ():
        if k.lower() == name:
            return v
    return None


DRAIN_BYTES_FACTOR = 4  # an oversized body is read and dropped up to this many times the cap ...
DRAIN_SECONDS = 5.0  # ... or for this long, before the 413 is sent


async def drain_body(receive: Receive, max_bytes: int, max_seconds: float = DRAIN_SECONDS) -> None:
    """Read and drop the rest of a request body, up to ``max_bytes`` bytes or ``max_seconds`` seconds.

    Answering 413 while the client is still sending and then closing the connection leaves unread bytes
    in the server's receive buffer, so the kernel resets the connection (RFC 1122 4.2.2.13) and the
    client can lose the response it was sent ("peer closed connection without sending complete message
    body"). Reading the rest first, within a bound, is the "lingering close" of HTTP servers (RFC 9112
    9.6); a body past the bound is cut off and the 413 is sent anyway.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + max_seconds
    drained = 0
    while drained <= max_bytes:
        try:
            message = await asyncio.wait_for(receive(), timeout=max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request":
            return
        drained += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


class GuardMiddleware:
    """Request id, body cap (413) and the single handler of unhandled exceptions (500, one log line).

    Args:
        app: the wrapped ASGI app.
        max_body_bytes: largest request body accepted, in bytes (None: no cap).
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int | None = None) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = (_header(scope, b"x-request-id") or b"").decode("latin-1")[:128] or uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        anthropic = is_anthropic_path(scope)
        limit = self.max_body_bytes
        if limit is not None:
            length = _header(scope, b"content-length")
            if length is not None and length.isdigit() and int(length) > limit:
                await drain_body(receive, DRAIN_BYTES_FACTOR * limit)
                await send_error(send, f"request body too large: {int(length)} bytes "
                                       f"(max_request_body_bytes={limit})", 413, [(b"connection", b"close")],
                                 anthropic)
                return
        started = False
        received = 0
        body_done = False  # the body's last message was read: nothing is left to drain
        too_large: list[str] = []

        async def drain() -> None:
            if not body_done:  # else receive() would wait for a message that never comes (DRAIN_SECONDS)
                await drain_body(receive, DRAIN_BYTES_FACTOR * limit)

        async def guarded_receive() -> Message:
            nonlocal received, body_done
            message = await receive()
            if limit is not None and message["type"] == "http.request":
                body_done = not message.get("more_body", False)
                received += len(message.get("body", b""))
                if received > limit:
                    too_large.append(f"request body too large: over {limit} bytes (max_request_body_bytes)")
                    raise BodyTooLarge(too_large[0])
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if too_large:  # the framework answered the interrupted body read (a 400): answer 413 instead
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await drain()
                    await send_error(send, too_large[0], 413, [(b"connection", b"close")], anthropic)
                return
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, guarded_receive, tracking_send)
        except BodyTooLarge as e:
            if not started:
                await drain()
                await send_error(send, str(e), 413, [(b"connection", b"close")], anthropic)
        except Exception as e:  # noqa: BLE001 - the one place unhandled errors end
            logger.error("unhandled error on %s %s (request id %s): %s: %s", scope.get("method"),
                         scope.get("path"), rid, type(e).__name__, e)
            logger.debug("traceback of request %s:\n%s", rid, "".join(traceback.format_exception(e)))
            if not started:
                await send_error(send, f"internal server error ({type(e).__name__}); request id {rid}", 500,
                                 anthropic=anthropic)


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every path but ``open_paths`` (constant-time comparison).

    Args:
        app: the wrapped ASGI app.
        api_keys: accepted keys (any one matches).
        open_paths: paths served without a key (exact match).
    """

    def __init__(self, app: ASGIApp, api_keys: list[str], open_paths: Iterable[str] = ()) -> None:
        self.app = app
        self.keys = [f"Bearer {k}".encode() for k in api_keys]
        self.open_paths = set(open_paths)

    def _authorized(self, scope: Scope) -> bool:
        got = _header(scope, b"authorization") or b""
        # Anthropic's clients send the key as ``x-api-key: <key>``: accepted as well
        api_key = b"Bearer " + (_header(scope, b"x-api-key") or b"")
        ok = False
        for k in self.keys:  # compare against every key: the time does not tell which one matched
            ok |= hmac.compare_digest(got, k)
            ok |= hmac.compare_digest(api_key, k)
        return ok

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or scope.get("path") in self.open_paths \
                or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        message = "invalid or missing API key (send the header Authorization: Bearer <key> or x-api-key: <key>)"
        await send_error(send, message, 401, [(b"www-authenticate", b"Bearer")], is_anthropic_path(scope))
