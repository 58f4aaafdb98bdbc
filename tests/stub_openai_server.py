"""A tiny OpenAI-compatible streaming server with known timings, for tests.

Runs FastAPI + uvicorn in a background thread on a free 127.0.0.1 port.
Every request streams ``max_tokens`` tokens: the first chunk after
``first_token_delay`` seconds, then one chunk every ``token_delay`` seconds;
each chunk carries ``tokens_per_chunk`` tokens (text `` r<req>t<i>``). The
final chunk carries ``usage`` with ``prompt_tokens`` (words, or ids for a
token-id prompt) and ``prompt_tokens_details.cached_tokens`` = the longest
common prefix (in words/ids) with any earlier prompt -- a fake prefix cache.

Prompts containing ``FAIL500`` / ``FAIL400`` get that HTTP status;
``FAILSTREAM`` gets one token and then an in-stream error event.
The server records every request (arrival time, path, body, prompt) and the
maximum number of simultaneously in-flight requests.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse


def _units(prompt: Any) -> list:
    if isinstance(prompt, list):
        return list(prompt)
    return str(prompt).split()


def _common_prefix(a: list, b: list) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class StubServer:
    def __init__(
        self,
        first_token_delay: float = 0.2,
        token_delay: float = 0.05,
        tokens_per_chunk: int = 1,
    ):
        self.first_token_delay = first_token_delay
        self.token_delay = token_delay
        self.tokens_per_chunk = tokens_per_chunk
        self.records: list[dict[str, Any]] = []
        self.inflight = 0
        self.max_inflight = 0
        self._seen: list[list] = []
        self._lock = threading.Lock()
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    # -------------------------------------------------------------- app
    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/v1/completions")
        async def completions(req: Request):
            return await self._handle(req, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(req: Request):
            return await self._handle(req, chat=True)

        return app

    def reset(self) -> None:
        with self._lock:
            self.records.clear()
            self._seen.clear()
            self.max_inflight = 0

    async def _handle(self, req: Request, chat: bool):
        arrival = time.perf_counter()
        body = await req.json()
        prompt = body["messages"][-1]["content"] if chat else body["prompt"]
        units = _units(prompt)
        with self._lock:
            rid = len(self.records)
            cached = max((_common_prefix(units, s) for s in self._seen), default=0)
            self._seen.append(units)
            self.records.append(
                {"id": rid, "arrival": arrival, "path": req.url.path, "body": body, "prompt": prompt}
            )
        text = str(prompt)
        if "FAIL500" in text:
            return JSONResponse({"error": {"message": "stub internal error"}}, status_code=500)
        if "FAIL400" in text:
            return JSONResponse({"error": {"message": "stub bad request"}}, status_code=400)
        n = int(body.get("max_tokens", 16))
        usage = {
            "prompt_tokens": len(units),
            "completion_tokens": n,
            "total_tokens": len(units) + n,
            "prompt_tokens_details": {"cached_tokens": cached},
        }
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        fail_stream = "FAILSTREAM" in text
        with self._lock:
            self.inflight += 1
            self.max_inflight = max(self.max_inflight, self.inflight)

        def chunk(piece: str) -> str:
            if chat:
                choice = {"index": 0, "delta": {"content": piece}, "finish_reason": None}
                obj = "chat.completion.chunk"
            else:
                choice = {"index": 0, "text": piece, "finish_reason": None}
                obj = "text_completion"
            d = {"id": f"stub-{rid}", "object": obj, "model": body.get("model"), "choices": [choice]}
            return f"data: {json.dumps(d)}\n\n"

        async def gen():
            try:
                t_start = time.perf_counter()
                sent = 0
                k = 0
                while sent < n:
                    # Absolute schedule, so per-chunk overheads do not accumulate.
                    due = t_start + self.first_token_delay + k * self.token_delay
                    await asyncio.sleep(max(0.0, due - time.perf_counter()))
                    m = min(self.tokens_per_chunk, n - sent)
                    yield chunk("".join(f" r{rid}t{sent + i}" for i in range(m)))
                    sent += m
                    k += 1
                    if fail_stream:
                        yield 'data: {"error": {"message": "stub stream failure", "code": 500}}\n\n'
                        return
                if include_usage:
                    d = {"id": f"stub-{rid}", "object": "chunk", "choices": [], "usage": usage}
                    yield f"data: {json.dumps(d)}\n\n"
                yield "data: [DONE]\n\n"
            finally:
                with self._lock:
                    self.inflight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    # -------------------------------------------------------------- lifecycle
    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> "StubServer":
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [sock]}, daemon=True
        )
        self._thread.start()
        deadline = time.time() + 10
        while not self._server.started:
            if time.time() > deadline or not self._thread.is_alive():
                raise RuntimeError("stub server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=5)

    def __enter__(self) -> "StubServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
