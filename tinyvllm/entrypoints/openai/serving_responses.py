"""``/v1/responses``: OpenAI's Responses API as a translation layer onto the chat path
(:class:`OpenAIServingChat`: the same chat template, sampling params, grammar-constrained tool calls,
structured output, tool-call parser and reasoning parser), with stored, continuable conversations.

Endpoints: ``POST /v1/responses`` (JSON, SSE streaming with ``sequence_number``ed events, or ``background``),
``GET`` / ``DELETE /v1/responses/{id}``, ``POST /v1/responses/{id}/cancel`` (a background or streaming
response still in progress). Errors have OpenAI's shape.

**State.** With ``store`` (the default) a finished response is kept in :class:`ResponseStore` (SQLite, bounded
by count, bytes and idle time) with what continuing it needs: the conversation as chat messages and the token
ids the engine saw (prompt and output). ``previous_response_id`` continues it: the stored conversation, then
the new input, rendered after this request's ``instructions`` (which, as in OpenAI's API, are not carried over).
With ``--api-key`` a response is visible only with the key that stored it (a SHA-256 of the key is kept).

**Warm KV.** The continuation's prompt starts with exactly the token ids of the stored prompt and output, so
the prefix cache (and the KV offload tier, after a restart) serves them: the new conversation is rendered and
tokenized as chat would; if its first tokens are the stored prompt's own rendering (SmolLM2's ChatML template
re-renders earlier turns identically; a template that does not is detected by a hash, and the conversation is
then sent as rendered), the stored prompt ids and the generated ids replace that part, and the rest is appended.
The generated ids replace the reply's re-tokenized text only when that text tokenizes to the same ids as it
does in the rendering (else the rendering's ids of the reply follow the stored prompt): the model's own tokens
are what the cache holds, whatever a fresh tokenization of the same text would give.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import time
import uuid
from array import array
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from tinyvllm.engine.async_llm import RequestStream
from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest
from tinyvllm.entrypoints.openai.responses_protocol import ResponsesRequest
from tinyvllm.entrypoints.openai.responses_store import ResponseStore, owner_of
from tinyvllm.entrypoints.openai.serving_chat import OpenAIServingChat
from tinyvllm.entrypoints.openai.serving_engine import (REQUEST_ERRORS, cached_of, error_body, error_response,
                                                        exception_response, json_encoder, run_blocking, status_of)
from tinyvllm.entrypoints.openai.serving_usage import UsageTracker

logger = logging.getLogger("tinyvllm.responses")

_decoder = msgspec.json.Decoder()
# chat field -> the Responses field it came from (for the ``param`` of a 400)
_RENAMES = {"messages": "input", "max_tokens": "max_output_tokens", "response_format": "text.format"}


def _ids_hash(ids: list[int]) -> str:
    return hashlib.sha256(array("i", ids).tobytes()).hexdigest()


def _not_found(response_id: str, param: str = "response_id") -> JSONResponse:
    shown = response_id if len(response_id) <= 80 else response_id[:80] + "..."
    return error_response(f"No response found with id '{shown}' (never stored, deleted, expired, evicted, or "
                          f"stored under another API key).", 404, param)


@dataclass
class StoreConfig:
    """The store's flags: ``--responses-store-path`` (``:memory:`` for none on disk), ``-max-count``,
    ``-max-bytes``, ``-ttl`` (seconds unused before a response expires)."""

    path: str = ":memory:"
    max_count: int = 10_000
    max_bytes: int = 256 << 20
    ttl_s: float = 7 * 86400.0


@dataclass
class _Run:
    """A response being generated: what ``GET`` shows and ``cancel`` stops."""

    response: dict
    owner: str
    task: asyncio.Task | None = None
    events: asyncio.Queue | None = None  # SSE bytes (streaming), None at the end
    deleted: bool = False  # DELETEd while in progress: not stored when it ends


class _Output:
    """Builds the output items from the model's text as it streams (and the SSE events for them), split by the
    chat path's output parser (:meth:`OpenAIServing.output_parser`): a ``reasoning`` item (when the server has a
    reasoning parser and the model thought), a ``message`` with one ``output_text`` part, then one
    ``function_call`` item per parsed tool call."""

    def __init__(self, response_id: str, parser: Any, emit: Callable[[str, dict], None]) -> None:
        self.rid = response_id
        self.parser = parser  # ChatOutputParser | None
        self.emit = emit
        self.items: list[dict] = []
        self.msg: dict | None = None  # the open message item
        self.rs: dict | None = None  # the open reasoning item
        self.calls: list[dict] = []  # chat tool_calls, for the stored conversation

    def _reasoning(self, text: str) -> None:
        if self.rs is None:
            self.rs = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress", "summary": [],
                       "content": [{"type": "reasoning_text", "text": ""}]}
            self.items.append(self.rs)
            self.emit("response.output_item.added", {"output_index": len(self.items) - 1,
                                                     "item": dict(self.rs, content=[])})
        self.rs["content"][0]["text"] += text
        self.emit("response.reasoning_text.delta", {"item_id": self.rs["id"], "output_index": self.items.index(self.rs),
                                                    "content_index": 0, "delta": text})

    def _close_reasoning(self, status: str) -> None:
        if self.rs is None:
            return
        idx = self.items.index(self.rs)
        self.emit("response.reasoning_text.done", {"item_id": self.rs["id"], "output_index": idx, "content_index": 0,
                                                   "text": self.rs["content"][0]["text"]})
        self.rs["status"] = status
        self.emit("response.output_item.done", {"output_index": idx, "item": self.rs})
        self.rs = None

    def _open_message(self) -> None:
        self.msg = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}
        idx = len(self.items)
        self.items.append(self.msg)
        self.emit("response.output_item.added", {"output_index": idx, "item": dict(self.msg, content=[])})
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self.msg["content"].append(part)
        self.emit("response.content_part.added", {"item_id": self.msg["id"], "output_index": idx,
                                                  "content_index": 0, "part": dict(part)})

    def _close_message(self, status: str) -> None:
        if self.msg is None:
            return
        idx = self.items.index(self.msg)
        part = self.msg["content"][0]
        self.emit("response.output_text.done", {"item_id": self.msg["id"], "output_index": idx, "content_index": 0,
                                                "text": part["text"], "logprobs": []})
        self.emit("response.content_part.done", {"item_id": self.msg["id"], "output_index": idx,
                                                 "content_index": 0, "part": dict(part)})
        self.msg["status"] = status
        self.emit("response.output_item.done", {"output_index": idx, "item": self.msg})
        self.msg = None

    def feed(self, delta: str, final: bool) -> None:
        reasoning, text, chunks = self.parser.feed(delta, final) if self.parser is not None else ("", delta, [])
        if reasoning:
            self._reasoning(reasoning)
        if text or chunks:
            self._close_reasoning("completed")
        if text:
            if self.msg is None:
                self._open_message()
            self.msg["content"][0]["text"] += text
            self.emit("response.output_text.delta", {"item_id": self.msg["id"], "output_index": len(self.items) - 1,
                                                     "content_index": 0, "delta": text, "logprobs": []})
        for chunk in chunks:
            for c in chunk:
                if "id" in c:  # a call begins (complete: its arguments follow at once)
                    self._close_message("completed")
                    item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                            "call_id": c["id"], "name": c["function"]["name"], "arguments": ""}
                    self.items.append(item)
                    self.emit("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)})
                else:
                    item, idx = self.items[-1], len(self.items) - 1
                    args = c["function"]["arguments"]
                    self.emit("response.function_call_arguments.delta", {"item_id": item["id"], "output_index": idx,
                                                                         "delta": args})
                    item["arguments"], item["status"] = args, "completed"
                    self.emit("response.function_call_arguments.done", {"item_id": item["id"], "output_index": idx,
                                                                        "name": item["name"], "arguments": args})
                    self.emit("response.output_item.done", {"output_index": idx, "item": item})
                    self.calls.append({"id": item["call_id"], "type": "function",
                                       "function": {"name": item["name"], "arguments": args}})

    def finish(self, status: str) -> None:
        """Close the open items (``status``: their status); an output with no message or call gets an empty
        message."""
        self._close_reasoning(status)
        if not any(i["type"] != "reasoning" for i in self.items):
            self._open_message()
        self._close_message(status)

    @property
    def text(self) -> str:
        return "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message")


class OpenAIServingResponses:
    """The Responses endpoints, over the chat endpoint's internals, with the response store."""

    def __init__(self, chat: OpenAIServingChat, store_config: StoreConfig | None = None,
                 auth_enabled: bool = False) -> None:
        self.chat = chat
        self.tokenizer = chat.tokenizer
        self.store_config = store_config or StoreConfig()
        self.auth_enabled = auth_enabled
        self._store: ResponseStore | None = None
        self._runs: dict[str, _Run] = {}
        self.continuations: Counter = Counter()  # how previous_response_id prompts were built (see the module doc)

    # ------------------------------------------------------------------ store
    async def store(self) -> ResponseStore:
        """The store, opened on first use (so a server that never sees /v1/responses touches no file)."""
        if self._store is None:
            c = self.store_config
            store = await asyncio.to_thread(ResponseStore, c.path, c.max_count, c.max_bytes, c.ttl_s)
            if self._store is None:
                self._store = store
                logger.info("responses store: %s (max %d responses, %d bytes, ttl %gs)", c.path, c.max_count,
                            c.max_bytes, c.ttl_s)
            else:
                store.close()
        return self._store

    async def _load(self, response_id: str, owner: str) -> dict | None:
        data = await asyncio.to_thread((await self.store()).get, response_id, owner)
        return None if data is None else _decoder.decode(data)

    async def _save(self, response_id: str, owner: str, record: dict) -> None:
        await asyncio.to_thread((await self.store()).put, response_id, owner, json_encoder.encode(record))

    def owner(self, raw: Request) -> str:
        """The request's owner tag: its API key's hash when the server checks keys, else ``""``."""
        if not self.auth_enabled:
            return ""
        auth = raw.headers.get("authorization") or ""
        key = auth[7:] if auth.startswith("Bearer ") else raw.headers.get("x-api-key")
        return owner_of(key)

    # ------------------------------------------------------------------ GET / DELETE / cancel
    async def retrieve(self, response_id: str, raw: Request) -> Response:
        owner = self.owner(raw)
        run = self._runs.get(response_id)
        if run is not None and run.owner == owner:
            return JSONResponse(run.response)
        rec = await self._load(response_id, owner)
        if rec is None:
            return _not_found(response_id)
        response = rec["response"]
        if response.get("status") == "in_progress" and response_id not in self._runs:
            # stored in progress (background) by a server that stopped before it finished
            response = {**response, "status": "failed", "error": {
                "code": "server_error", "message": "the server stopped before this background response finished"}}
        return Response(json_encoder.encode(response), media_type="application/json")

    async def delete(self, response_id: str, raw: Request) -> Response:
        owner = self.owner(raw)
        run = self._runs.get(response_id)
        if run is not None and run.owner == owner:
            run.deleted = True
            if run.task is not None:
                run.task.cancel()
        deleted = await asyncio.to_thread((await self.store()).delete, response_id, owner)
        if not deleted and not (run is not None and run.owner == owner):
            return _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})

    async def cancel(self, response_id: str, raw: Request) -> Response:
        owner = self.owner(raw)
        run = self._runs.get(response_id)
        if run is None or run.owner != owner:
            rec = await self._load(response_id, owner)
            if rec is None:
                return _not_found(response_id)
            return error_response(f"Cannot cancel response '{response_id}': it is already "
                                  f"{rec['response'].get('status')} (only a background or streaming response in "
                                  f"progress can be cancelled)", 400, "response_id")
        task = run.task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await asyncio.shield(task)
        return JSONResponse(run.response)

    # ------------------------------------------------------------------ create
    async def create(self, req: ResponsesRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        if (err := self.chat.check_model(req.model)) is not None:
            return err
        owner = self.owner(raw)
        try:
            req.check()
            prev = None
            if req.previous_response_id is not None:
                prev = await self._load(req.previous_response_id, owner)
                if prev is None:
                    return _not_found(req.previous_response_id, "previous_response_id")
            conversation = (prev["conversation"] if prev else []) + req.input_messages()
            system = [{"role": "system", "content": req.instructions}] if req.instructions is not None else []
            try:
                chat_req = ChatCompletionRequest.model_validate(req.chat_body(system + conversation))
            except ValidationError as e:
                err = e.errors()[0]
                where = ".".join(str(x) for x in err.get("loc", ()))
                param = _RENAMES.get(where.split(".")[0], where.split(".")[0]) if where else None
                return error_response(f"invalid request: {param or where}: {err.get('msg')}", 400, param)
            params, rendered, use_tools = await self.chat.chat_prompt(chat_req)
            ids, how = await run_blocking(self._continue, prev, rendered)
            self.continuations[how] += 1
            response_id = f"resp_{uuid.uuid4().hex}"
            stream = self.chat._submit(response_id, [(None, ids)], params, arrival,
                                       prefix_cache_debug=bool(req.prefix_cache_debug), user=req.user)[0]
        except REQUEST_ERRORS as e:
            if str(getattr(e, "param", None) or "").startswith("messages["):  # a chat message: of the input
                e.param = "input"  # type: ignore[union-attr]
            return exception_response(e, _RENAMES)
        model = req.model or self.chat.model_name
        response = self._response(response_id, req, model, "in_progress", [], None)
        run = _Run(response, owner, events=asyncio.Queue() if req.stream else None)
        record = {"conversation": conversation, "prompt_ids": ids, "render_len": len(rendered),
                  "render_hash": _ids_hash(rendered), "how": how}
        logger.debug("response %s: prompt of %d tokens (%s)", response_id, len(ids), how)
        tracker = UsageTracker(1, self.tokenizer, bool(req.prefix_cache_debug), response_id)
        work = self._generate(run, req, stream, record, use_tools, tracker)
        if req.background:  # stored as in progress first, so that the finished one replaces it
            self._runs[response_id] = run
            try:
                await self._save(response_id, owner, {"response": response, **record, "output_ids": [],
                                                      "raw_text": ""})
            except BaseException:
                self._runs.pop(response_id, None)
                stream.abort()
                work.close()
                raise
            run.task = asyncio.ensure_future(work)
            return JSONResponse(response)
        run.task = asyncio.ensure_future(work)
        if req.stream:
            self._runs[response_id] = run
            return StreamingResponse(self._sse(run), media_type="text/event-stream")
        watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
        try:
            done, _ = await asyncio.wait({run.task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
        if run.task not in done:  # the client went away
            run.task.cancel()
            return Response(status_code=499)
        err = run.task.result()
        if err is not None:
            return exception_response(err, _RENAMES)
        return JSONResponse(run.response)

    def _continue(self, prev: dict | None, rendered: list[int]) -> tuple[list[int], str]:
        """The prompt ids of a continuation (see the module doc) and how they were built: ``new`` (no
        previous response), ``appended`` (stored prompt + generated ids + the rest), ``prompt_appended``
        (stored prompt + the rendering's ids from the reply on), ``rerendered`` (the template renders the
        earlier turns differently: the rendering as it is)."""
        if prev is None:
            return rendered, "new"
        n = prev["render_len"]
        if len(rendered) < n or _ids_hash(rendered[:n]) != prev["render_hash"]:
            return rendered, "rerendered"
        rest = rendered[n:]
        out = list(prev["output_ids"])
        special = set(self.tokenizer.all_special_ids)
        while out and out[-1] in special:  # the end-of-turn token the template writes after the reply
            out.pop()
        text = prev["raw_text"]
        if out and self.tokenizer.decode(out) == text:
            reply = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if rest[:len(reply)] == reply:
                return prev["prompt_ids"] + out + rest[len(reply):], "appended"
        return prev["prompt_ids"] + rest, "prompt_appended"

    def _response(self, response_id: str, req: ResponsesRequest, model: str, status: str, output: list,
                  usage: dict | None, error: dict | None = None, incomplete: dict | None = None) -> dict:
        fmt = (req.text or {}).get("format") or {"type": "text"}
        return {"id": response_id, "object": "response", "created_at": int(time.time()), "status": status,
                "background": bool(req.background), "completed_at": None, "error": error,
                "incomplete_details": incomplete, "instructions": req.instructions,
                "max_output_tokens": req.max_output_tokens, "max_tool_calls": None, "metadata": req.metadata or {},
                "model": model, "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
                "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": bool(req.store), "temperature": 1.0 if req.temperature is None else req.temperature,
                "text": {"format": fmt}, "tool_choice": req.tool_choice if req.tool_choice is not None else "auto",
                "tools": req.tools or [], "top_p": 1.0 if req.top_p is None else req.top_p,
                "truncation": "disabled", "usage": usage, "user": req.user}

    async def _generate(self, run: _Run, req: ResponsesRequest, stream: RequestStream, record: dict,
                        use_tools: bool, tracker: UsageTracker) -> BaseException | None:
        """Consume the engine's outputs into ``run.response`` (and SSE events when streaming); store the
        finished response. Returns the request error that ended it before any output (non-streaming: answered
        as an error, not stored), else None."""
        rid = run.response["id"]
        seq = 0
        events = run.events

        def emit(kind: str, body: dict) -> None:
            nonlocal seq
            if events is not None:
                events.put_nowait(b"event: " + kind.encode() + b"\ndata: " +
                                  json_encoder.encode({"type": kind, "sequence_number": seq, **body}) + b"\n\n")
                seq += 1

        out = _Output(rid, self.chat.output_parser(record["prompt_ids"], use_tools), emit)
        emit("response.created", {"response": run.response})
        emit("response.in_progress", {"response": run.response})
        prompt_tokens = len(record["prompt_ids"])
        output_ids: list[int] = []
        raw_text = ""
        cached = 0
        finish = None
        status, error, incomplete, final_event = "completed", None, None, "response.completed"
        try:
            async for o in stream:
                cached = cached_of(o)
                tracker.observe(0, o)
                for c in o.outputs:
                    output_ids.extend(c.token_ids)
                    raw_text += c.text
                    out.feed(c.text, final=c.finish_reason is not None)
                    if c.finish_reason is not None:
                        finish = c.finish_reason
            if finish == "length":
                status, incomplete, final_event = "incomplete", {"reason": "max_output_tokens"}, "response.incomplete"
        except asyncio.CancelledError:
            stream.abort()
            status, final_event = "cancelled", "response.failed"
            error = {"code": "cancelled", "message": "cancelled by POST /v1/responses/{id}/cancel"}
        except REQUEST_ERRORS as e:
            stream.abort()
            if events is None and not output_ids and not req.background:
                self._runs.pop(rid, None)
                return e
            status, final_event = "failed", "response.failed"
            error = {"code": "server_error" if status_of(e) >= 500 else "invalid_request", "message": str(e)}
        except Exception as e:  # noqa: BLE001 - the response fails, the server goes on
            stream.abort()
            logger.error("response %s failed: %s: %s", rid, type(e).__name__, e)
            status, final_event = "failed", "response.failed"
            error = {"code": "server_error", "message": f"internal server error ({type(e).__name__})"}
        out.finish("incomplete" if status != "completed" else "completed")
        usage = tracker.extend(_usage(prompt_tokens, len(output_ids), cached))
        if req.prefix_cache_debug and isinstance(usage.get("prefix_cache"), dict):
            usage["prefix_cache"]["continuation"] = record["how"]  # how the prompt was built (_continue)
        run.response = {**run.response, "status": status, "output": out.items, "usage": usage, "error": error,
                        "incomplete_details": incomplete, "completed_at": int(time.time()) if status == "completed"
                        else None}
        if req.store and not run.deleted:
            reply: dict = {"role": "assistant", "content": out.text}
            if out.calls:
                reply["tool_calls"] = out.calls
            try:
                await asyncio.shield(self._save(rid, run.owner, {
                    "response": run.response, **record, "conversation": record["conversation"] + [reply],
                    "output_ids": output_ids, "raw_text": raw_text}))
            except Exception as e:  # noqa: BLE001 - a store failure must not fail the answer
                logger.error("response %s not stored: %s: %s", rid, type(e).__name__, e)
        emit(final_event, {"response": run.response})
        if events is not None:
            events.put_nowait(None)
        self._runs.pop(rid, None)
        return None

    async def _sse(self, run: _Run) -> AsyncIterator[bytes]:
        try:
            while (item := await run.events.get()) is not None:
                yield item
        finally:  # the client went away (or the stream ended): stop generating
            if run.task is not None and not run.task.done():
                run.task.cancel()


def _usage(prompt_tokens: int, output_tokens: int, cached: Any) -> dict:
    """The Responses usage object; ``input_tokens_details.cached_tokens`` counts prefix-cache hits in the pool
    and the KV offload tier (``cached_tokens_tier``, an extension present when the tier served some: its part)."""
    details = {"cached_tokens": int(cached), "cache_write_tokens": 0}
    if getattr(cached, "tier", 0):
        details["cached_tokens_tier"] = cached.tier
    return {"input_tokens": prompt_tokens, "input_tokens_details": details, "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": prompt_tokens + output_tokens}


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        if (await raw.receive())["type"] == "http.disconnect":
            return


__all__ = ["OpenAIServingResponses", "ResponsesRequest", "StoreConfig", "error_body"]
