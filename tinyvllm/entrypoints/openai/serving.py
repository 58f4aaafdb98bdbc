"""The logic behind the OpenAI endpoints: completions, chat completions, tokenize, detokenize.

Each handler validates the request (400 before anything reaches the engine),
tokenizes (chat template for chat), hands one :class:`RequestStream` per prompt
to the engine, and either streams Server-Sent Events in OpenAI's chunk format
(ending with ``data: [DONE]``) or collects the deltas into one response. A
client that goes away mid-request (streaming: the response generator is
cancelled; non-streaming: an ``http.disconnect`` arrives) gets its request
aborted in the engine, which frees its KV blocks at the next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from tinyvllm.engine.async_llm import (AsyncLLM, EngineDeadError, EngineOverloadedError, EngineShutdownError,
                                       InvalidRequestError, RequestStream)
from tinyvllm.engine.tokenizer import apply_chat_template
from tinyvllm.entrypoints.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                                  TokenizeRequest)
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger("tinyvllm.serving")

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "BadRequestError",
                422: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}
_SAMPLING_FIELDS = {"n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
                    "include_stop_str_in_output", "logit_bias", "best_of", "suffix", "stream_options",
                    "top_logprobs", "prompt", "messages"}
_json = msgspec.json.Encoder()
# What a request can fail with that is answered as an error object (400 / 503 / 500), not a traceback.
_REQUEST_ERRORS = (ValueError, EngineOverloadedError, EngineShutdownError, EngineDeadError)


# ----------------------------------------------------------------------------- errors


def error_body(message: str, status: int, param: str | None = None, err_type: str | None = None) -> dict:
    return {"error": {"message": message, "type": err_type or _ERROR_TYPES.get(status, "Error"), "param": param,
                      "code": status}}


def error_response(message: str, status: int = 400, param: str | None = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param), status_code=status)


def _param_of(e: ValueError, renames: dict[str, str] | None = None) -> str | None:
    param = getattr(e, "param", None)
    if param is None:
        first = str(e).split(" ", 1)[0].strip(":,")
        param = first if first in _SAMPLING_FIELDS else None
    if param is not None and renames:
        param = renames.get(param, param)
    return param


def status_of(e: BaseException) -> int:
    if isinstance(e, (EngineOverloadedError, EngineShutdownError)):
        return 503
    if isinstance(e, ValueError):
        return 400
    return 500


def exception_response(e: BaseException, renames: dict[str, str] | None = None) -> JSONResponse:
    status = status_of(e)
    if status == 500 and not isinstance(e, EngineDeadError):
        logger.exception("internal error", exc_info=e)
    param = _param_of(e, renames) if isinstance(e, ValueError) else None
    return error_response(str(e) or type(e).__name__, status, param)


def _sse(obj: Any) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


_DONE = b"data: [DONE]\n\n"


def _clamp(lp: float) -> float:
    return max(lp, -9999.0)


# ----------------------------------------------------------------------------- helpers


async def _wait_for_disconnect(raw: Request) -> None:
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(raw: Request, work: Awaitable[Response], on_disconnect: Callable[[], None]
                               ) -> Response:
    """Await ``work``; if the client disconnects first, cancel it and call ``on_disconnect``."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(raw))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        on_disconnect()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    on_disconnect()
    with contextlib.suppress(BaseException):
        await task
    return Response(status_code=499)


async def iterate_streams(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' delta outputs as ``(prompt index, output)``, in arrival order."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, s: RequestStream) -> None:
        try:
            async for out in s:
                queue.put_nowait((i, out))
            queue.put_nowait((i, None))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass
class _Choice:
    """A choice being accumulated (non-streaming) or tracked (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions logprobs: offset of the next token
    started: bool = False


def _accumulate(ch: _Choice, c: Any) -> None:
    """Fold one streamed delta (a CompletionOutput in delta mode) into a non-streaming choice."""
    ch.text += c.text
    ch.token_ids.extend(c.token_ids)
    if c.logprobs:
        ch.logprobs.extend(c.logprobs)
    if c.finish_reason is not None:
        ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason


async def _collect(streams: list[RequestStream], n: int) -> tuple[dict[int, _Choice], int]:
    """Fold every delta of ``streams`` (``n`` samples each) into choices ``prompt index * n + sample``;
    returns them and the prompt tokens served from the prefix cache. Aborts the streams when done."""
    choices = {i: _Choice() for i in range(len(streams) * n)}
    cached = [0] * len(streams)
    try:
        async with contextlib.aclosing(iterate_streams(streams)) as it:
            async for pi, out in it:
                cached[pi] = out.num_cached_tokens
                for c in out.outputs:
                    _accumulate(choices[pi * n + c.index], c)
    finally:
        for s in streams:
            s.abort()
    return choices, sum(cached)


def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


# ----------------------------------------------------------------------------- serving


class OpenAIServing:
    """All endpoint logic over one :class:`AsyncLLM`."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str] | None = None) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names or [engine.model_name]
        self.model_name = self.served_model_names[0]

    # -------------------------------------------------------------- models
    def check_model(self, model: str | None) -> JSONResponse | None:
        if model is None or model == "" or model in self.served_model_names:
            return None
        return error_response(f"The model `{model}` does not exist.", 404, "model")

    def _response_model(self, model: str | None) -> str:
        return model or self.model_name

    def list_models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "tinyvllm",
             "root": str(self.engine.resolved.model_dir), "parent": None, "max_model_len": self.engine.max_model_len}
            for name in self.served_model_names]}

    # -------------------------------------------------------------- tokenization
    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _completion_prompts(self, req: CompletionRequest) -> list[tuple[str | None, list[int]]]:
        p = req.prompt
        if isinstance(p, str):
            items: list[Any] = [p]
        elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
            items = [list(p)]
        else:
            items = list(p)
        if not items:
            raise InvalidRequestError("prompt must not be empty", "prompt")
        out = []
        for item in items:
            if isinstance(item, str):
                if not item:
                    raise InvalidRequestError("prompt must not be empty", "prompt")
                out.append((item, self._encode(item, req.add_special_tokens)))
            else:
                if not item:
                    raise InvalidRequestError("prompt must not be empty", "prompt")
                out.append((None, list(item)))
        return out

    def _chat_prompt_ids(self, req: ChatCompletionRequest | TokenizeRequest, messages: list,
                         add_generation_prompt: bool, continue_final_message: bool = False) -> list[int]:
        msgs = []
        for i, m in enumerate(messages):
            d = m.model_dump(exclude_none=True)
            if d.get("role") not in _CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}, "
                                          f"got {d.get('role')!r}", "messages")
            if d["role"] == "developer":
                d["role"] = "system"
            msgs.append(d)
        kwargs = dict(req.chat_template_kwargs or {})
        if continue_final_message:
            if msgs[-1]["role"] != "assistant":
                raise InvalidRequestError("continue_final_message needs a final assistant message", "messages")
            kwargs["continue_final_message"] = True
            add_generation_prompt = False
        try:
            return apply_chat_template(self.tokenizer, msgs, add_generation_prompt, **kwargs)
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(str(e), "messages") from e
        except Exception as e:  # a template error (jinja) is the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from e

    async def tokenize(self, req: TokenizeRequest) -> Response:
        if (err := self.check_model(req.model)) is not None:
            return err
        try:
            if (req.prompt is None) == (req.messages is None):
                raise InvalidRequestError("give exactly one of prompt or messages", "prompt")
            if req.messages is not None:
                # The chat template already places the special tokens (as for chat completions).
                ids = self._chat_prompt_ids(req, req.messages, req.add_generation_prompt)
            else:
                ids = self._encode(req.prompt, True if req.add_special_tokens is None else req.add_special_tokens)
        except ValueError as e:
            return exception_response(e)
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.engine.max_model_len})

    async def detokenize(self, req: DetokenizeRequest) -> Response:
        if (err := self.check_model(req.model)) is not None:
            return err
        vocab = self.engine.vocab_size
        if any(t < 0 or t >= vocab for t in req.tokens):
            return error_response(f"tokens must be in [0, {vocab})", 400, "tokens")
        return JSONResponse({"prompt": self.tokenizer.decode(req.tokens)})

    # -------------------------------------------------------------- logprobs
    def _token_text(self, tid: int, entry: dict[int, Logprob]) -> str:
        lp = entry.get(tid)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tid])

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int,
                             choice: _Choice) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs):
            text = self._token_text(tid, entry)
            lp = entry.get(tid)
            tokens.append(text)
            token_lps.append(_clamp(lp.logprob) if lp is not None else None)
            top: dict[str, float] = {}
            for t, v in entry.items():
                if t == tid or (v.rank is not None and v.rank <= top_n):
                    top.setdefault(v.decoded_token if v.decoded_token is not None else self.tokenizer.decode([t]),
                                   _clamp(v.logprob))
            tops.append(top)
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int) -> dict:
        content = []
        for tid, entry in zip(token_ids, logprobs):
            text = self._token_text(tid, entry)
            lp = entry.get(tid)
            ranked = sorted(((v.rank, t, v) for t, v in entry.items() if v.rank is not None and v.rank <= top_n),
                            key=lambda x: (x[0], x[1]))[:top_n]
            tops = []
            for _, t, v in ranked:
                s = v.decoded_token if v.decoded_token is not None else self.tokenizer.decode([t])
                tops.append({"token": s, "logprob": _clamp(v.logprob), "bytes": list(s.encode("utf-8"))})
            content.append({"token": text, "logprob": _clamp(lp.logprob) if lp is not None else -9999.0,
                            "bytes": list(text.encode("utf-8")), "top_logprobs": tops})
        return {"content": content}

    # -------------------------------------------------------------- submission
    def _submit(self, base_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                arrival: float) -> list[RequestStream]:
        for _, ids in prompts:  # validate every prompt before queueing any
            self.engine.check_request(ids, params)
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(self.engine.add_request(rid, text, ids, params, arrival, checked=True))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams

    # -------------------------------------------------------------- completions
    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        if (err := self.check_model(req.model)) is not None:
            return err
        try:
            params = req.to_sampling_params()
            prompts = self._completion_prompts(req)
            request_id = f"cmpl-{uuid.uuid4().hex}"
            streams = self._submit(request_id, prompts, params, arrival)
        except _REQUEST_ERRORS as e:
            return exception_response(e)
        model = self._response_model(req.model)
        created = int(time.time())
        if req.stream:
            return StreamingResponse(self._completion_stream(req, params, prompts, streams, request_id, model,
                                                             created), media_type="text/event-stream")

        def abort_all() -> None:
            for s in streams:
                s.abort()

        return await run_until_disconnect(
            raw, self._completion_full(req, params, prompts, streams, request_id, model, created), abort_all)

    def _prompt_text(self, prompts: list[tuple[str | None, list[int]]], i: int) -> str:
        text, ids = prompts[i]
        return text if text is not None else self.tokenizer.decode(ids)

    async def _completion_full(self, req: CompletionRequest, params: SamplingParams, prompts: list, streams: list,
                               request_id: str, model: str, created: int) -> Response:
        n = params.n
        try:
            choices, cached = await _collect(streams, n)
        except _REQUEST_ERRORS as e:
            return exception_response(e)
        out_choices = []
        for idx, ch in choices.items():
            pi = idx // n
            text = ch.text
            lp = None
            prompt_text = self._prompt_text(prompts, pi) if req.echo else ""
            text = prompt_text + text
            if params.logprobs is not None:
                if req.echo:
                    ch.text_offset = len(prompt_text)
                lp = self._completion_logprobs(ch.token_ids, ch.logprobs, params.logprobs, ch)
            out_choices.append({"index": idx, "text": text, "logprobs": lp, "finish_reason": ch.finish_reason,
                                "stop_reason": ch.stop_reason})
        usage = _usage(sum(len(ids) for _, ids in prompts), sum(len(ch.token_ids) for ch in choices.values()),
                       cached)
        return Response(_json.encode({"id": request_id, "object": "text_completion", "created": created,
                                      "model": model, "choices": out_choices, "usage": usage}),
                        media_type="application/json")

    async def _completion_stream(self, req: CompletionRequest, params: SamplingParams, prompts: list, streams: list,
                                 request_id: str, model: str, created: int) -> AsyncIterator[bytes]:
        n = params.n
        include_usage = req.include_usage
        choices = {i: _Choice() for i in range(len(prompts) * n)}
        cached = [0] * len(prompts)
        try:
            async with contextlib.aclosing(iterate_streams(streams)) as it:
                async for pi, out in it:
                    cached[pi] = out.num_cached_tokens
                    for c in out.outputs:
                        idx = pi * n + c.index
                        ch = choices[idx]
                        ch.token_ids.extend(c.token_ids)
                        text = c.text
                        if req.echo and not ch.started:
                            prompt_text = self._prompt_text(prompts, pi)
                            text = prompt_text + text
                            ch.text_offset = len(prompt_text)
                        lp = None
                        if params.logprobs is not None and c.logprobs:
                            lp = self._completion_logprobs(c.token_ids, c.logprobs, params.logprobs, ch)
                        if not text and c.finish_reason is None and lp is None:
                            continue  # nothing visible yet (held back for a stop string / partial character)
                        ch.started = True
                        chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                                 "choices": [{"index": idx, "text": text, "logprobs": lp,
                                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                        if include_usage:
                            chunk["usage"] = None
                        yield _sse(chunk)
            if include_usage:
                usage = _usage(sum(len(ids) for _, ids in prompts),
                               sum(len(ch.token_ids) for ch in choices.values()), sum(cached))
                yield _sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage})
            yield _DONE
        except _REQUEST_ERRORS as e:
            yield _sse(error_body(str(e), status_of(e)))
            yield _DONE
        finally:
            for s in streams:
                s.abort()

    # -------------------------------------------------------------- chat
    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        if (err := self.check_model(req.model)) is not None:
            return err
        renames = {"logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        try:
            params = req.to_sampling_params()
            ids = self._chat_prompt_ids(req, req.messages, req.add_generation_prompt, req.continue_final_message)
            request_id = f"chatcmpl-{uuid.uuid4().hex}"
            streams = self._submit(request_id, [(None, ids)], params, arrival)
        except _REQUEST_ERRORS as e:
            return exception_response(e, renames)
        model = self._response_model(req.model)
        created = int(time.time())
        top_n = params.logprobs if req.logprobs else None
        if req.stream:
            return StreamingResponse(self._chat_stream(req, params, ids, streams[0], request_id, model, created,
                                                       top_n), media_type="text/event-stream")
        return await run_until_disconnect(
            raw, self._chat_full(params, ids, streams[0], request_id, model, created, top_n), streams[0].abort)

    async def _chat_full(self, params: SamplingParams, ids: list[int], stream: RequestStream, request_id: str,
                         model: str, created: int, top_n: int | None) -> Response:
        try:
            choices, cached = await _collect([stream], params.n)
        except _REQUEST_ERRORS as e:
            return exception_response(e)
        out_choices = []
        for idx, ch in choices.items():
            lp = self._chat_logprobs(ch.token_ids, ch.logprobs, top_n) if top_n is not None else None
            out_choices.append({"index": idx, "message": {"role": "assistant", "content": ch.text},
                                "logprobs": lp, "finish_reason": ch.finish_reason, "stop_reason": ch.stop_reason})
        usage = _usage(len(ids), sum(len(ch.token_ids) for ch in choices.values()), cached)
        return Response(_json.encode({"id": request_id, "object": "chat.completion", "created": created,
                                      "model": model, "choices": out_choices, "usage": usage}),
                        media_type="application/json")

    async def _chat_stream(self, req: ChatCompletionRequest, params: SamplingParams, ids: list[int],
                           stream: RequestStream, request_id: str, model: str, created: int, top_n: int | None
                           ) -> AsyncIterator[bytes]:
        include_usage = req.include_usage
        completion_tokens = 0
        cached = 0

        def chunk(choices: list[dict]) -> bytes:
            obj = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices}
            if include_usage:
                obj["usage"] = None
            return _sse(obj)

        try:
            for i in range(params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for out in stream:
                cached = out.num_cached_tokens
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if top_n is not None and c.logprobs:
                        lp = self._chat_logprobs(c.token_ids, c.logprobs, top_n)
                    if not c.text and c.finish_reason is None and lp is None:
                        continue
                    delta = {"content": c.text} if c.text or c.finish_reason is None else {}
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}])
            if include_usage:
                yield _sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": _usage(len(ids), completion_tokens, cached)})
            yield _DONE
        except _REQUEST_ERRORS as e:
            yield _sse(error_body(str(e), status_of(e)))
            yield _DONE
        finally:
            stream.abort()
