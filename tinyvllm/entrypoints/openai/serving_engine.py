"""What the OpenAI endpoints share: OpenAI-shaped error bodies and responses, the request errors that are
answered as such, Server-Sent Events, the wait that aborts a request whose client went away, the interleaving
and collecting of the engine's streams, usage, and :class:`OpenAIServing`, the base of the endpoint classes
(model check, tokenization, chat template, token text of logprobs, submission).

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
import functools
import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tinyvllm.engine.async_llm import (AsyncLLM, EngineDeadError, EngineOverloadedError, EngineShutdownError,
                                       InvalidRequestError, RequestStream)
from tinyvllm.engine.tokenizer import apply_chat_template
from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest, TokenizeRequest
from tinyvllm.entrypoints.openai.serving_usage import UsageTracker
from tinyvllm.outputs import Logprob, RequestOutput
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger("tinyvllm.serving")

_ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 405: "MethodNotAllowed", 413: "BadRequestError",
                422: "BadRequestError", 500: "InternalServerError", 503: "ServiceUnavailableError"}
_CHAT_ROLES = {"system", "user", "assistant", "developer", "tool"}
_SAMPLING_FIELDS = {"cache_salt", "n", "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                    "frequency_penalty", "max_tokens", "min_tokens", "seed", "stop", "stop_token_ids", "ignore_eos",
                    "logprobs", "prompt_logprobs", "skip_special_tokens", "spaces_between_special_tokens",
                    "include_stop_str_in_output", "logit_bias", "best_of", "suffix", "stream_options",
                    "top_logprobs", "prompt", "messages"}
json_encoder = msgspec.json.Encoder()
# What a request can fail with that is answered as an error object (400 / 503), not a traceback.
REQUEST_ERRORS = (ValueError, EngineOverloadedError, EngineShutdownError, EngineDeadError)


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
    if isinstance(e, (EngineOverloadedError, EngineShutdownError, EngineDeadError)):  # the service, not the request
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


def stream_failure(e: BaseException, request_id: str) -> bytes:
    """The error event that ends a stream an unexpected exception broke (logged once, with the request id)."""
    logger.error("unhandled error in the stream of request %s: %s: %s", request_id, type(e).__name__, e)
    return sse(error_body(f"internal server error ({type(e).__name__}); request id {request_id}", 500))


def sse(obj: Any) -> bytes:
    return b"data: " + json_encoder.encode(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


def clamp_logprob(lp: float) -> float:
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


def data_parallel_rank(raw: Request) -> int | None:
    """vLLM's ``X-data-parallel-rank`` request header: the replica to serve this request (None if absent).

    Raises:
        InvalidRequestError: not an integer (a rank out of range is refused by the engine).
    """
    value = raw.headers.get("x-data-parallel-rank")
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise InvalidRequestError(f"X-data-parallel-rank must be an integer, got {value!r}",
                                  "X-data-parallel-rank") from None


@dataclass
class Choice:
    """A choice being accumulated (non-streaming) or tracked (streaming)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # completions logprobs: offset of the next token
    started: bool = False


def _accumulate(ch: Choice, c: Any) -> None:
    """Fold one streamed delta (a CompletionOutput in delta mode) into a non-streaming choice."""
    ch.text += c.text
    ch.token_ids.extend(c.token_ids)
    if c.logprobs:
        ch.logprobs.extend(c.logprobs)
    if c.finish_reason is not None:
        ch.finish_reason, ch.stop_reason = c.finish_reason, c.stop_reason


async def collect(streams: list[RequestStream], n: int, usage: UsageTracker | None = None,
                  prompt_logprobs: dict[int, list] | None = None,
                  kv_transfer_params: dict | None = None) -> tuple[dict[int, Choice], int]:
    """Fold every delta of ``streams`` (``n`` samples each) into choices ``prompt index * n + sample``;
    returns them and the prompt tokens served from the prefix cache. Aborts the streams when done.
    ``usage`` (if given) observes every output (KV cost, prefix-cache report); ``prompt_logprobs`` (if
    given) is filled with prompt index -> the request's prompt logprobs; ``kv_transfer_params`` (if given)
    with the engine's ``kv_transfer_params`` for the response (P/D disaggregation)."""
    choices = {i: Choice() for i in range(len(streams) * n)}
    cached = [0] * len(streams)
    try:
        async with contextlib.aclosing(iterate_streams(streams)) as it:
            async for pi, out in it:
                cached[pi] = cached_of(out)
                if usage is not None:
                    usage.observe(pi, out)
                if prompt_logprobs is not None and out.prompt_logprobs is not None:
                    prompt_logprobs[pi] = out.prompt_logprobs
                if kv_transfer_params is not None and out.kv_transfer_params:
                    kv_transfer_params.update(out.kv_transfer_params)
                for c in out.outputs:
                    _accumulate(choices[pi * n + c.index], c)
    finally:
        for s in streams:
            s.abort()
    return choices, sum_cached(cached)


class CachedTokens(int):
    """Prompt tokens served from a cache (``usage.prompt_tokens_details.cached_tokens``), carrying
    ``tier``: the part of them loaded from the KV offload tier."""

    tier: int = 0


def cached_of(out: Any) -> CachedTokens:
    """The cached tokens of a request output, with their offload-tier part."""
    c = CachedTokens(out.num_cached_tokens)
    c.tier = getattr(out, "num_cached_tokens_tier", 0)
    return c


def sum_cached(values: list) -> CachedTokens:
    total = CachedTokens(sum(values))
    total.tier = sum(getattr(v, "tier", 0) for v in values)
    return total


def usage_info(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    """OpenAI's usage object. ``prompt_tokens_details.cached_tokens`` counts prefix-cache hits in the pool
    and in the KV offload tier; the extension field ``cached_tokens_tier`` (present when the tier served
    some) is the tier's part."""
    details = {"cached_tokens": int(cached)}
    if getattr(cached, "tier", 0):
        details["cached_tokens_tier"] = cached.tier
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": details}


# ----------------------------------------------------------------------------- off the event loop

# Tokenization and chat templating run here, not on the event loop, so one huge prompt never stalls /health
# or the other requests' streams. One thread: a fast tokenizer is not safe to re-configure concurrently, and
# one thread keeps the event loop's own detokenization from competing with several.
_TOKENIZE_POOL: ThreadPoolExecutor | None = None


async def run_blocking(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` on the tokenization thread; returns (or raises) what it does."""
    global _TOKENIZE_POOL
    if _TOKENIZE_POOL is None:
        _TOKENIZE_POOL = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-tokenize")
    return await asyncio.get_running_loop().run_in_executor(_TOKENIZE_POOL, functools.partial(fn, *args))


_MAX_TOKEN_CHARS: dict[int, int] = {}


def max_token_chars(tokenizer: Any) -> int:
    """The longest token of ``tokenizer``'s vocabulary, in characters of its token string (for byte-level BPE,
    one character per byte): a text of ``L`` characters needs at least ``L / max_token_chars`` tokens."""
    key = id(tokenizer)
    if key not in _MAX_TOKEN_CHARS:
        vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
        _MAX_TOKEN_CHARS[key] = max((len(t) for t in vocab), default=64) or 1
    return _MAX_TOKEN_CHARS[key]


def _check_tool_call_id(i: int, call_id: str | None, known: set[str]) -> None:
    """A ``tool`` message (``messages[i]``) answers a call: its ``tool_call_id`` must be given and be the
    ``id`` of a tool call of an earlier assistant message (as OpenAI requires).

    Raises:
        InvalidRequestError: ``param="messages[i].tool_call_id"``.
    """
    param = f"messages[{i}].tool_call_id"
    if not call_id:
        raise InvalidRequestError(f"{param}: a message with role 'tool' needs a tool_call_id (the id of the "
                                  f"assistant's tool call it answers)", param)
    if call_id not in known:
        shown = call_id if len(call_id) <= 64 else call_id[:64] + "..."
        raise InvalidRequestError(f"{param}: {shown!r} is not the id of a tool call of an earlier assistant "
                                  f"message (known: {', '.join(sorted(known)[:8]) or 'none'})", param)


def _decoded_arguments(call: Any) -> Any:
    """A history tool call with its ``function.arguments`` JSON text decoded to an object, as vLLM hands
    them to chat templates (Llama 3's and Gemma's write the arguments with ``tojson`` or item by item;
    Qwen's accept either). Text that is not a JSON object is left as it is."""
    if not isinstance(call, dict) or not isinstance(call.get("function"), dict):
        return call
    args = call["function"].get("arguments")
    if isinstance(args, str):
        try:
            obj = json.loads(args)
        except ValueError:
            return call
        if isinstance(obj, dict):
            return {**call, "function": {**call["function"], "arguments": obj}}
    return call


# ----------------------------------------------------------------------------- base


class OpenAIServing:
    """The base of the endpoint classes, over one :class:`AsyncLLM`."""

    def __init__(self, engine: AsyncLLM, served_model_names: list[str] | None = None,
                 chat_template: str | None = None, tool_call_parser: str | None = None,
                 reasoning_parser: str | None = None) -> None:
        """``chat_template``: Jinja text replacing the model's (``--chat-template``); ``tool_call_parser``:
        the format of the model's tool calls (``--tool-call-parser``: ``hermes``, the default, ``mistral``,
        ``pythonic``, ``llama3_json``, or ``auto``, chosen from the chat template); ``reasoning_parser``:
        ``--reasoning-parser`` (``qwen3``; None: the thinking stays in the content)."""
        from tinyvllm.entrypoints.openai.reasoning import get_reasoning_parser
        from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser, select_tool_parser

        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.served_model_names = served_model_names or [engine.model_name]
        self.model_name = self.served_model_names[0]
        self.chat_template = chat_template
        name = tool_call_parser or "hermes"
        if name == "auto":
            name = select_tool_parser(self._template_text())
            logger.info("--tool-call-parser auto: %s (from the chat template)", name)
        get_tool_parser(name)  # a bad name fails here, at start
        self.tool_call_parser = name
        self.reasoning_parser = get_reasoning_parser(reasoning_parser) if reasoning_parser else None

    def _template_text(self) -> str:
        """The chat template's text (``--chat-template`` or the model's; every named template of a model
        that has several)."""
        if self.chat_template is not None:
            return self.chat_template
        own = getattr(self.tokenizer, "chat_template", None)
        if isinstance(own, dict):
            return "\n".join(str(v) for v in own.values())
        return own if isinstance(own, str) else ""

    def tool_parser(self):  # -> ToolParser
        """A parser of the server's tool-call format (a fresh one: it makes the calls' ids)."""
        from tinyvllm.entrypoints.openai.tool_parsers import get_tool_parser

        return get_tool_parser(self.tool_call_parser)

    def prompt_opens_thought(self, ids: list[int]) -> bool:
        """Whether the prompt ``ids`` end inside an open reasoning block (the template started the
        thought); False without a reasoning parser."""
        if self.reasoning_parser is None or not ids:
            return False
        tail = self.tokenizer.decode(ids[-32:], skip_special_tokens=False)
        return self.reasoning_parser.prompt_opens(tail)

    def output_parser(self, ids: list[int], use_tools: bool):  # -> ChatOutputParser | None
        """A parser of one choice's output (reasoning, then tool calls), for the prompt ``ids``; None when
        there is nothing to parse (no reasoning parser, no tools)."""
        from tinyvllm.entrypoints.openai.chat_output import ChatOutputParser

        if self.reasoning_parser is None and not use_tools:
            return None
        return ChatOutputParser(self.reasoning_parser, self.prompt_opens_thought(ids),
                                self.tool_parser() if use_tools else None)

    def keep_marker_tokens(self, params: SamplingParams, use_tools: bool) -> None:
        """Turn ``skip_special_tokens`` off when a marker the parsers read (``[TOOL_CALLS]``,
        ``<|python_tag|>``, ``<think>``) is a special token of this tokenizer: the text must keep it."""
        markers: list[str] = []
        if use_tools:
            markers += self.tool_parser().markers
        if self.reasoning_parser is not None:
            markers += [self.reasoning_parser.start, self.reasoning_parser.end]
        special = set(getattr(self.tokenizer, "all_special_tokens", ()) or ())
        if any(m in special for m in markers):
            params.skip_special_tokens = False

    async def check_structured_outputs(self, params: SamplingParams, param: str) -> None:
        """Raise ``GrammarError`` (a 400 naming ``param``) unless the request's constraint compiles.

        Only the tokenizer-independent grammar is built here (well under a millisecond for ordinary
        schemas), in a thread: the first call also imports xgrammar (about 1-3 s, it imports torch),
        which must not stall the event loop. The token masks are compiled by the engine core, off its
        step loop."""
        if params.structured_outputs is None:
            return
        from tinyvllm.structured_output import validate

        await asyncio.to_thread(validate, params.structured_outputs, param)

    def _template_for(self, msgs: list[dict], tools: list[dict] | None) -> str | None:
        """The chat template to render with: ``--chat-template`` if given; tinyvllm's tool-capable
        (Hermes) template when the request has tools or tool messages, the model's template ignores them
        and the tool-call parser is ``hermes``."""
        if self.chat_template is not None:
            return self.chat_template
        needs_tools = bool(tools) or any(m.get("role") == "tool" or m.get("tool_calls") for m in msgs)
        own = self.tokenizer.chat_template
        if needs_tools and self.tool_call_parser == "hermes" and (not isinstance(own, str) or "tool" not in own):
            from tinyvllm.entrypoints.openai.tool_calls import builtin_tool_template

            return builtin_tool_template()
        return None

    # -------------------------------------------------------------- model
    def check_model(self, model: str | None) -> JSONResponse | None:
        if model is None or model == "" or model in self.served_model_names:
            return None
        return error_response(f"The model `{model}` does not exist.", 404, "model")

    def _response_model(self, model: str | None) -> str:
        return model or self.model_name

    # -------------------------------------------------------------- tokenization
    @property
    def max_prompt_chars(self) -> int:
        """Characters of text beyond which a prompt cannot fit ``max_model_len`` tokens whatever it says
        (``max_model_len * max_token_chars``): such text is refused before it is tokenized."""
        return max(1, self.engine.max_model_len) * max_token_chars(self.tokenizer)

    def check_text_length(self, chars: int, param: str) -> None:
        """Raise :class:`InvalidRequestError` (400, ``param``) if ``chars`` characters cannot fit the context."""
        if chars > self.max_prompt_chars:
            raise InvalidRequestError(
                f"{param} is too long: {chars} characters cannot fit this model's maximum context length "
                f"(max_model_len) of {self.engine.max_model_len} tokens", param)

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text`` (run it with :func:`run_blocking`: it is CPU work)."""
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def _chat_prompt_ids(self, req: ChatCompletionRequest | TokenizeRequest, messages: list,
                         add_generation_prompt: bool, continue_final_message: bool = False,
                         tools: list[dict] | None = None) -> list[int]:
        msgs = []
        chars = 0
        call_ids: set[str] = set()  # ids of the tool calls of the assistant messages so far
        for i, m in enumerate(messages):
            d = m.model_dump(exclude_none=True)
            chars += len(str(d.get("content") or ""))
            if d.get("role") not in _CHAT_ROLES:
                raise InvalidRequestError(f"messages[{i}].role must be one of {sorted(_CHAT_ROLES)}, "
                                          f"got {d.get('role')!r}", "messages")
            if d["role"] == "assistant" and isinstance(d.get("tool_calls"), list):
                call_ids.update(c["id"] for c in d["tool_calls"]
                                if isinstance(c, dict) and isinstance(c.get("id"), str))
                d["tool_calls"] = [_decoded_arguments(c) for c in d["tool_calls"]]
            elif d["role"] == "tool":
                _check_tool_call_id(i, d.get("tool_call_id"), call_ids)
            if d["role"] == "developer":
                d["role"] = "system"
            msgs.append(d)
        if isinstance(req, ChatCompletionRequest):  # /tokenize has no context limit to meet
            self.check_text_length(chars, "messages")
        kwargs = dict(req.chat_template_kwargs or {})
        top = getattr(req, "enable_thinking", None)  # the top-level field some clients send
        if top is not None:
            if kwargs.get("enable_thinking", top) != top:
                raise InvalidRequestError("enable_thinking and chat_template_kwargs.enable_thinking disagree",
                                          "enable_thinking")
            kwargs["enable_thinking"] = top
        if "enable_thinking" in kwargs and not isinstance(kwargs["enable_thinking"], bool):
            raise InvalidRequestError("chat_template_kwargs.enable_thinking must be a boolean (true or false)",
                                      "chat_template_kwargs.enable_thinking")
        if continue_final_message:
            if msgs[-1]["role"] != "assistant":
                raise InvalidRequestError("continue_final_message needs a final assistant message", "messages")
            kwargs["continue_final_message"] = True
            add_generation_prompt = False
        template = self._template_for(msgs, tools)
        if template is not None:
            kwargs["chat_template"] = template
        if tools:
            kwargs["tools"] = tools
        try:
            return apply_chat_template(self.tokenizer, msgs, add_generation_prompt, **kwargs)
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(str(e), "messages") from e
        except Exception as e:  # a template error (jinja) is the request's fault
            raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from e

    # -------------------------------------------------------------- logprobs
    def _token_text(self, tid: int, entry: dict[int, Logprob]) -> str:
        lp = entry.get(tid)
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.tokenizer.decode([tid])

    def prompt_logprobs_json(self, entries: list) -> list:
        """vLLM's ``prompt_logprobs``: per prompt token ``None`` (the first) or ``{token id: {"logprob",
        "rank", "decoded_token"}}``."""
        return [None if e is None else
                {str(t): {"logprob": clamp_logprob(v.logprob), "rank": v.rank,
                          "decoded_token": v.decoded_token if v.decoded_token is not None else self.tokenizer.decode([t])}
                 for t, v in e.items()} for e in entries]

    # -------------------------------------------------------------- submission
    def _submit(self, base_id: str, prompts: list[tuple[str | None, list[int]]], params: SamplingParams,
                arrival: float, *, prefix_cache_debug: bool = False, user: str | None = None,
                raw: Request | None = None) -> list[RequestStream]:
        """Validate every prompt, then send each to the engine. ``raw``'s ``X-data-parallel-rank`` header
        (vLLM's) sends them to that replica of a ``--data-parallel-size`` server."""
        for _, ids in prompts:  # validate every prompt before queueing any
            self.engine.check_request(ids, params)
        kw = {}
        if raw is not None and (rank := data_parallel_rank(raw)) is not None:
            kw["data_parallel_rank"] = rank
        streams: list[RequestStream] = []
        try:
            for i, (text, ids) in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(self.engine.add_request(rid, text, ids, params, arrival, checked=True,
                                                       prefix_cache_debug=prefix_cache_debug, user=user, **kw))
        except BaseException:
            for s in streams:
                s.abort()
            raise
        return streams
