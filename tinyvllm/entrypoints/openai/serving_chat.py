"""``POST /v1/chat/completions``: messages through the chat template, ``n`` samples, logprobs in the chat
format; JSON or SSE streaming (a role chunk per choice first)."""

from __future__ import annotations

import time
import uuid
from typing import AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tinyvllm.engine.async_llm import RequestStream
from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest
from tinyvllm.entrypoints.openai.serving_usage import UsageTracker
from tinyvllm.entrypoints.openai.serving_engine import (REQUEST_ERRORS, SSE_DONE, OpenAIServing, clamp_logprob,
                                                        stream_failure,
                                                        collect, error_body, exception_response, json_encoder,
                                                        run_blocking, run_until_disconnect, sse, status_of,
                                                        usage_info)
from tinyvllm.entrypoints.openai.serving_engine import cached_of
from tinyvllm.entrypoints.openai.chat_output import ChatOutputParser
from tinyvllm.entrypoints.openai.tool_calls import check_tool_choice, check_tools, tool_grammar
from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import SamplingParams


class OpenAIServingChat(OpenAIServing):
    """The chat completions endpoint."""

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
                tops.append({"token": s, "logprob": clamp_logprob(v.logprob), "bytes": list(s.encode("utf-8"))})
            content.append({"token": text, "logprob": clamp_logprob(lp.logprob) if lp is not None else -9999.0,
                            "bytes": list(text.encode("utf-8")), "top_logprobs": tops})
        return {"content": content}

    async def create_chat_completion(self, req: ChatCompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        if (err := self.check_model(req.model)) is not None:
            return err
        renames = {"logprobs": "top_logprobs",
                   "max_tokens": "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"}
        try:
            params, ids, streams, request_id, use_tools = await self.prepare_chat(req, arrival, raw=raw)
        except REQUEST_ERRORS as e:
            return exception_response(e, renames)
        model = self._response_model(req.model)
        created = int(time.time())
        top_n = params.logprobs if req.logprobs else None
        if req.stream:
            return StreamingResponse(self._chat_stream(req, params, ids, streams[0], request_id, model, created,
                                                       top_n, use_tools), media_type="text/event-stream")
        return await run_until_disconnect(
            raw, self._chat_full(params, ids, streams[0], request_id, model, created, top_n,
                                 UsageTracker(1, self.tokenizer, req.prefix_cache_debug, request_id), use_tools),
            streams[0].abort)

    async def chat_prompt(self, req: ChatCompletionRequest) -> tuple[SamplingParams, list[int], bool]:
        """The request checked and rendered: its sampling params, prompt token ids and whether tools are
        in use (shown to the model, calls parsed). Raises one of ``REQUEST_ERRORS`` for a bad request."""
        tools = check_tools(req.tools) if req.tools is not None else None
        choice = check_tool_choice(req.tool_choice, tools)
        use_tools = choice not in (None, "none")  # tools shown to the model, calls parsed
        ids: list[int] | None = None
        tag = None
        if use_tools:  # the grammar in the parser's format, after a reasoning block if the prompt opened one
            ids = await run_blocking(self._chat_prompt_ids, req, req.messages, req.add_generation_prompt,
                                     req.continue_final_message, tools)
            prefix = (self.reasoning_parser.grammar_prefix(self.prompt_opens_thought(ids))
                      if self.reasoning_parser is not None else None)
            tag = tool_grammar(self.tool_parser(), tools, choice, req.parallel_tool_calls is not False, prefix)
        params = req.to_sampling_params(tag)
        await self.check_structured_outputs(params, req.structured_outputs_and_param(tag)[1])
        if ids is None:
            ids = await run_blocking(self._chat_prompt_ids, req, req.messages, req.add_generation_prompt,
                                     req.continue_final_message, None)
        self.keep_marker_tokens(params, use_tools)
        return params, ids, use_tools

    async def prepare_chat(self, req: ChatCompletionRequest, arrival: float, id_prefix: str = "chatcmpl-",
                           raw: Request | None = None
                           ) -> tuple[SamplingParams, list[int], list[RequestStream], str, bool]:
        """:meth:`chat_prompt`, then the request submitted to the engine: ``(params, prompt ids, streams,
        request id, use_tools)``. Shared by ``/v1/chat/completions`` and the Anthropic ``/v1/messages``."""
        params, ids, use_tools = await self.chat_prompt(req)
        request_id = f"{id_prefix}{uuid.uuid4().hex}"
        streams = self._submit(request_id, [(None, ids)], params, arrival,
                               prefix_cache_debug=req.prefix_cache_debug, user=req.user, raw=raw)
        return params, ids, streams, request_id, use_tools

    async def _chat_full(self, params: SamplingParams, ids: list[int], stream: RequestStream, request_id: str,
                         model: str, created: int, top_n: int | None, tracker: UsageTracker,
                         use_tools: bool = False) -> Response:
        prompt_lps: dict[int, list] = {}
        try:
            kv_params: dict = {}
            choices, cached = await collect([stream], params.n, tracker, prompt_lps, kv_params)
        except REQUEST_ERRORS as e:
            return exception_response(e)
        out_choices = []
        for idx, ch in choices.items():
            lp = self._chat_logprobs(ch.token_ids, ch.logprobs, top_n) if top_n is not None else None
            message: dict = {"role": "assistant", "content": ch.text}
            finish = ch.finish_reason
            if (parser := self.output_parser(ids, use_tools)) is not None:
                # an unfinished call (cut by max_tokens) is dropped, never left in the content
                reasoning, content, calls = parser.parse(ch.text)
                message = {"role": "assistant", "content": content if content is not None or ch.text else ""}
                if parser.reasoning is not None:
                    message["reasoning_content"] = reasoning
                if calls:
                    message["tool_calls"] = [c.as_openai() for c in calls]
                    if finish == "stop":
                        finish = "tool_calls"
            out_choices.append({"index": idx, "message": message,
                                "logprobs": lp, "finish_reason": finish, "stop_reason": ch.stop_reason})
        usage = tracker.extend(usage_info(len(ids), sum(len(ch.token_ids) for ch in choices.values()), cached))
        body = {"id": request_id, "object": "chat.completion", "created": created, "model": model,
                "choices": out_choices, "usage": usage}
        if params.prompt_logprobs is not None:  # vLLM's extension, at the top level for chat
            body["prompt_logprobs"] = self.prompt_logprobs_json(prompt_lps.get(0) or [])
        if kv_params:  # P/D disaggregation: what the decode engine needs (vLLM's field)
            body["kv_transfer_params"] = kv_params
        return Response(json_encoder.encode(body), media_type="application/json")

    async def _chat_stream(self, req: ChatCompletionRequest, params: SamplingParams, ids: list[int],
                           stream: RequestStream, request_id: str, model: str, created: int, top_n: int | None,
                           use_tools: bool = False) -> AsyncIterator[bytes]:
        include_usage = req.include_usage
        parsers: dict[int, ChatOutputParser | None] = {i: self.output_parser(ids, use_tools)
                                                       for i in range(params.n)}
        completion_tokens = 0
        cached = 0
        tracker = UsageTracker(1, self.tokenizer, req.prefix_cache_debug, request_id)

        def chunk(choices: list[dict]) -> bytes:
            obj = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": choices}
            if include_usage:
                obj["usage"] = None
            return sse(obj)

        try:
            for i in range(params.n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])
            async for out in stream:
                cached = cached_of(out)
                tracker.observe(0, out)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    lp = None
                    if top_n is not None and c.logprobs:
                        lp = self._chat_logprobs(c.token_ids, c.logprobs, top_n)
                    text, finish, reasoning = c.text, c.finish_reason, ""
                    if (parser := parsers[c.index]) is not None:
                        reasoning, text, call_chunks = parser.feed(c.text, final=finish is not None)
                        if reasoning:  # vLLM's delta field for the thinking
                            yield chunk([{"index": c.index, "delta": {"reasoning_content": reasoning},
                                          "logprobs": None, "finish_reason": None}])
                        for calls in call_chunks:
                            yield chunk([{"index": c.index, "delta": {"tool_calls": calls}, "logprobs": None,
                                          "finish_reason": None}])
                        if finish == "stop" and parser.num_calls:
                            finish = "tool_calls"
                    if not text and finish is None and lp is None:
                        continue
                    delta = {"content": text} if text or finish is None else {}
                    yield chunk([{"index": c.index, "delta": delta, "logprobs": lp,
                                  "finish_reason": finish, "stop_reason": c.stop_reason}])
            if include_usage:
                yield sse({"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
                            "choices": [], "usage": tracker.extend(usage_info(len(ids), completion_tokens, cached))})
            yield SSE_DONE
        except REQUEST_ERRORS as e:
            yield sse(error_body(str(e), status_of(e)))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the stream has started: end it with an error event
            yield stream_failure(e, request_id)
            yield SSE_DONE
        finally:
            stream.abort()
