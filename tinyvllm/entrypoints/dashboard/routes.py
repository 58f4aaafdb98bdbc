"""HTTP routes of the dashboard: the page (package data, no external assets) and its SSE stream."""

from __future__ import annotations

import asyncio
from importlib import resources
from typing import AsyncIterator

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, StreamingResponse

from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.entrypoints.dashboard.hub import DashboardHub

EVENT_INTERVAL_S = 0.5
_encoder = msgspec.json.Encoder()


def _page() -> str:
    return resources.files("tinyvllm.entrypoints.dashboard").joinpath("static/dashboard.html").read_text("utf-8")


def add_dashboard_routes(app: FastAPI, engine: AsyncLLM, interval: float = EVENT_INTERVAL_S) -> DashboardHub:
    """Register ``GET /dashboard`` and ``GET /dashboard/events`` on ``app``; returns the hub."""
    hub = DashboardHub(engine)
    page = _page()
    app.state.dashboard = hub

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    @app.get("/dashboard/events", include_in_schema=False)
    async def dashboard_events(raw: Request) -> StreamingResponse:
        async def events() -> AsyncIterator[bytes]:
            cursor: dict[str, int] = {}
            yield b"retry: 1000\n\n"  # EventSource reconnects after 1 s when the server goes away
            while engine.accepting:
                yield b"data: " + _encoder.encode(hub.snapshot(cursor)) + b"\n\n"
                await asyncio.sleep(interval)
                if await raw.is_disconnected():
                    return

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"})

    return hub
