"""``POST /v1/completions``: one prompt or several (text or token ids), ``n`` samples each, ``echo``,
logprobs in the completions format; JSON or SSE streaming."""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from tinyvllm import envs
from tinyvllm.engine.async_llm import InvalidRequestError
from tinyvllm.entrypoints.openai.protocol import CompletionRequest
from tinyvllm.entrypoints.openai.serving_usage import UsageTracker
from tinyvllm.entrypoints.openai.serving_engine import (REQUEST_ERRORS, SSE_DONE, Choice, OpenAIServing,
                                                        clamp_logprob, collect, error_body, exception_response,
                                                        iterate_streams, json_encoder, run_blocking,
                                                        run_until_disconnect, sse, status_of, stream_failure,
                                                        usage_info)
from tinyvllm.entrypoints.openai.serving_engine import cached_of, sum_cached
from tinyvllm.outputs import Logprob
from tinyvllm.sampling_params import SamplingParams


class OpenAIServingCompletion(OpenAIServing):
    """The completions endpoint."""

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
        limit = envs.TINYVLLM_MAX_N_SEQUENCES
        if len(items) * req.n > limit:
            raise InvalidRequestError(f"prompt: {len(items)} prompts x n={req.n} samples is over the limit of "
                                      f"{limit} sequences per request (TINYVLLM_MAX_N_SEQUENCES)", "prompt")
        for item in items:  # every text checked before any is tokenized
            if isinstance(item, str):
                self.check_text_length(len(item), "prompt")
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

    def _completion_logprobs(self, token_ids: list[int], logprobs: list[dict[int, Logprob]], top_n: int,
                             choice: Choice) -> dict:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(token_ids, logprobs):
            text = self._token_text(tid, entry)
            lp = entry.get(tid)
            tokens.append(text)
            token_lps.append(clamp_logprob(lp.logprob) if lp is not None else None)
            top: dict[str, float] = {}
            for t, v in entry.items():
                if t == tid or (v.rank is not None and v.rank <= top_n):
                    top.setdefault(v.decoded_token if v.decoded_token is not None else self.tokenizer.decode([t]),
                                   clamp_logprob(v.logprob))
            tops.append(top)
            offsets.append(choice.text_offset)
            choice.text_offset += len(text)
        return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}

    def _echo_logprobs(self, prompt_ids: list[int], prompt_lps: list | None, ch: Choice, top_n: int) -> dict:
        """echo + logprobs: the prompt tokens' logprobs (``None`` for the first) followed by the generated ones,
        offsets counted from the start of the echoed prompt."""
        if prompt_lps is None or len(prompt_lps) != len(prompt_ids):
            raise RuntimeError(f"prompt logprobs missing for an echo request ({prompt_lps and len(prompt_lps)} "
                               f"for {len(prompt_ids)} prompt tokens)")
        ch.text_offset = 0
        entries = [e if e is not None else {} for e in prompt_lps]
        head = self._completion_logprobs(prompt_ids, entries, top_n, ch)
        head["token_logprobs"][0], head["top_logprobs"][0] = None, None
        tail = self._completion_logprobs(ch.token_ids, ch.logprobs, top_n, ch)
        return {k: head[k] + tail[k] for k in head}

    async def create_completion(self, req: CompletionRequest, raw: Request) -> Response:
        arrival = time.monotonic()
        if (err := self.check_model(req.model)) is not None:
            return err
        try:
            params = req.to_sampling_params()
            await self.check_structured_outputs(params, "structured_outputs")
            prompts = await run_blocking(self._completion_prompts, req)
            request_id = f"cmpl-{uuid.uuid4().hex}"
            streams = self._submit(request_id, prompts, params, arrival, prefix_cache_debug=req.prefix_cache_debug,
                                   user=req.user, raw=raw)
        except REQUEST_ERRORS as e:
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
        prompt_lps: dict[int, list] = {}
        try:
            tracker = UsageTracker(len(prompts), self.tokenizer, req.prefix_cache_debug, request_id)
            kv_params: dict = {}
            choices, cached = await collect(streams, n, tracker, prompt_lps, kv_params)
        except REQUEST_ERRORS as e:
            return exception_response(e)
        out_choices = []
        for idx, ch in choices.items():
            pi = idx // n
            text = ch.text
            lp = None
            prompt_text = self._prompt_text(prompts, pi) if req.echo else ""
            text = prompt_text + text
            if params.logprobs is not None:
                lp = self._completion_logprobs(ch.token_ids, ch.logprobs, params.logprobs, ch) if not req.echo \
                    else self._echo_logprobs(prompts[pi][1], prompt_lps.get(pi), ch, params.logprobs)
            choice = {"index": idx, "text": text, "logprobs": lp, "finish_reason": ch.finish_reason,
                      "stop_reason": ch.stop_reason}
            if req.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self.prompt_logprobs_json(prompt_lps.get(pi) or [])
            out_choices.append(choice)
        usage = tracker.extend(usage_info(sum(len(ids) for _, ids in prompts),
                                          sum(len(ch.token_ids) for ch in choices.values()), cached))
        body = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                "choices": out_choices, "usage": usage}
        if kv_params:  # P/D disaggregation: what the decode engine needs (vLLM's field)
            body["kv_transfer_params"] = kv_params
        return Response(json_encoder.encode(body), media_type="application/json")

    async def _completion_stream(self, req: CompletionRequest, params: SamplingParams, prompts: list, streams: list,
                                 request_id: str, model: str, created: int) -> AsyncIterator[bytes]:
        n = params.n
        include_usage = req.include_usage
        choices = {i: Choice() for i in range(len(prompts) * n)}
        cached = [0] * len(prompts)
        tracker = UsageTracker(len(prompts), self.tokenizer, req.prefix_cache_debug, request_id)
        prompt_lps: dict[int, list] = {}
        try:
            async with contextlib.aclosing(iterate_streams(streams)) as it:
                async for pi, out in it:
                    cached[pi] = cached_of(out)
                    tracker.observe(pi, out)
                    if out.prompt_logprobs is not None:
                        prompt_lps[pi] = out.prompt_logprobs
                    for c in out.outputs:
                        idx = pi * n + c.index
                        ch = choices[idx]
                        ch.token_ids.extend(c.token_ids)
                        text = c.text
                        lp = None
                        first = req.echo and not ch.started
                        if first:
                            prompt_text = self._prompt_text(prompts, pi)
                            text = prompt_text + text
                            ch.text_offset = len(prompt_text)
                        if first and params.logprobs is not None:  # the prompt's logprobs, then this delta's
                            part = Choice(token_ids=list(c.token_ids), logprobs=list(c.logprobs or []))
                            lp = self._echo_logprobs(prompts[pi][1], prompt_lps.get(pi), part, params.logprobs)
                            ch.text_offset = part.text_offset
                        elif params.logprobs is not None and c.logprobs:
                            lp = self._completion_logprobs(c.token_ids, c.logprobs, params.logprobs, ch)
                        if not text and c.finish_reason is None and lp is None:
                            continue  # nothing visible yet (held back for a stop string / partial character)
                        ch.started = True
                        chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model,
                                 "choices": [{"index": idx, "text": text, "logprobs": lp,
                                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}]}
                        if req.prompt_logprobs is not None and not ch.started and pi in prompt_lps:
                            chunk["choices"][0]["prompt_logprobs"] = self.prompt_logprobs_json(prompt_lps[pi])
                        if include_usage:
                            chunk["usage"] = None
                        yield sse(chunk)
            if include_usage:
                usage = tracker.extend(usage_info(sum(len(ids) for _, ids in prompts),
                                                  sum(len(ch.token_ids) for ch in choices.values()),
                                                  sum_cached(cached)))
                yield sse({"id": request_id, "object": "text_completion", "created": created, "model": model,
                            "choices": [], "usage": usage})
            yield SSE_DONE
        except REQUEST_ERRORS as e:
            yield sse(error_body(str(e), status_of(e)))
            yield SSE_DONE
        except Exception as e:  # noqa: BLE001 - the stream has started: end it with an error event
            yield stream_failure(e, request_id)
            yield SSE_DONE
        finally:
            for s in streams:
                s.abort()
