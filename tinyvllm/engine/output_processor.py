"""Front-end output processing: incremental detokenization, stop strings, per-request outputs.

Runs where the text lives (the offline ``LLM`` process or the API server
process), overlapping the engine core's next step.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers.decoders import DecodeStream

from tinyvllm.engine.input_processor import child_request_ids
from tinyvllm.engine.messages import EngineCoreOutput
from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams

_PREFILL_CONTEXT = 4  # prompt tokens fed to the stream decoder so the first token decodes in context


class IncrementalDetokenizer:
    """Token ids -> text, one token at a time, never splitting a UTF-8 character.

    Uses ``tokenizers``' ``DecodeStream``, which buffers tokens until their bytes
    form complete characters (byte-level BPE splits emoji and CJK across tokens).
    Stop strings are matched on the accumulated text; :meth:`delta` holds back
    any tail that could still grow into a stop string, so no part of a stop
    string is ever sent to a streaming client.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self._tok = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer
        ctx = prompt_token_ids[-_PREFILL_CONTEXT:]
        self._stream = DecodeStream(ctx, skip_special_tokens=params.skip_special_tokens) if ctx else \
            DecodeStream(skip_special_tokens=params.skip_special_tokens)
        # Hugging Face's slow-tokenizer decode: added tokens are segments of their own, joined
        # to their neighbours with " " (PreTrainedTokenizer._decode, spaces_between_special_tokens).
        self._added_ids: frozenset[int] = frozenset()
        if params.spaces_between_special_tokens and not params.skip_special_tokens:
            self._added_ids = frozenset(getattr(tokenizer, "added_tokens_decoder", {}) or ())
        self._prev_added: bool | None = None  # None: no output text yet
        self.stop = list(params.stop or [])
        self.include_stop = params.include_stop_str_in_output
        self.text = ""
        self._sent = 0
        self._checked = 0

    def add_tokens(self, token_ids: list[int]) -> str | None:
        """Append tokens' text; return the stop string matched (text truncated there), else None."""
        for t in token_ids:
            piece = self._stream.step(self._tok, t)
            if piece:
                if self._added_ids:
                    added = t in self._added_ids
                    if self._prev_added is not None and (added or self._prev_added):
                        piece = " " + piece
                    self._prev_added = added
                self.text += piece
        if not self.stop:
            return None
        longest = max(len(s) for s in self.stop)
        start = max(0, self._checked - longest + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        self._checked = len(self.text)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + (len(s) if self.include_stop else 0)]
        return s

    def _holdback(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:k]):
                    best = k
                    break
        return best

    def delta(self, finished: bool) -> str:
        """Text not yet sent that is safe to send now."""
        end = len(self.text) if finished else len(self.text) - self._holdback()
        end = max(end, self._sent)
        out = self.text[self._sent:end]
        self._sent = end
        return out


@dataclass
class _SampleState:
    index: int
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_logprobs: int = 0
    kv: tuple[float, int, int, int] = (0.0, 0, 0, 0)  # the core's KV cost so far (see EngineCoreOutput)


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: dict[str, _SampleState]  # child (engine) request id -> state
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    prefix_cache: Any = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_cached_tokens_tier: int = 0
    kv_transfer_params: dict | None = None

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples.values())


class OutputProcessor:
    """Turns :class:`EngineCoreOutput` batches into :class:`RequestOutput` objects."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.requests: dict[str, _RequestState] = {}
        self.child_to_parent: dict[str, str] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams, arrival_time: float | None = None) -> list[str]:
        """Register a request; returns the engine-side child ids (one per sample)."""
        kids = child_request_ids(request_id, params.n)
        samples = {
            cid: _SampleState(i, IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params),
                              logprobs=[] if params.logprobs is not None else None,
                              cumulative_logprob=0.0 if params.logprobs is not None else None)
            for i, cid in enumerate(kids)
        }
        self.requests[request_id] = _RequestState(
            request_id, prompt, prompt_token_ids, params, samples,
            RequestMetrics(arrival_time=arrival_time or time.monotonic()))
        for cid in kids:
            self.child_to_parent[cid] = request_id
        return kids

    def abort_request(self, request_id: str) -> list[str]:
        """Forget a request; returns its unfinished child ids to abort in the engine."""
        st = self.requests.pop(request_id, None)
        if st is None:
            return []
        for cid in st.samples:
            self.child_to_parent.pop(cid, None)
        return [cid for cid, s in st.samples.items() if s.finish_reason is None]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _decode_token(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _logprob_entry(self, lp: Any) -> dict[int, Logprob]:
        """token id -> Logprob of one position: the top tokens (ranks 1..) and the actual token."""
        entry = {tid: Logprob(v, i + 1, self._decode_token(tid)) for i, (tid, v) in enumerate(lp.top)}
        entry[lp.token_id] = Logprob(lp.logprob, lp.rank, self._decode_token(lp.token_id))
        return entry

    def process_outputs(self, outputs: list[EngineCoreOutput], delta: bool = False
                        ) -> tuple[list[RequestOutput], list[str]]:
        """Apply one engine step's outputs.

        Args:
            outputs: the step's per-child outputs.
            delta: return only new text/tokens/logprobs of the samples touched
                (streaming) rather than whole samples.
        Returns:
            (request outputs for every touched request, child ids to abort in the
            engine because a stop string finished them).
        """
        now = time.monotonic()
        touched: dict[str, set[str]] = {}
        to_abort: list[str] = []
        for o in outputs:
            parent = self.child_to_parent.get(o.request_id)
            if parent is None:
                continue  # aborted by the front end meanwhile
            st = self.requests[parent]
            s = st.samples[o.request_id]
            if s.finish_reason is not None:
                continue
            if st.metrics.first_token_time is None:
                st.metrics.first_token_time = now
            st.num_cached_tokens = max(st.num_cached_tokens, o.num_cached_tokens)
            s.kv = (o.kv_block_seconds, o.peak_kv_blocks, o.num_prefill_computed, o.num_prefill_cached)
            if o.prefix_cache is not None and (st.prefix_cache is None or s.index == 0):
                st.prefix_cache = o.prefix_cache
            st.num_cached_tokens_tier = max(st.num_cached_tokens_tier, o.num_cached_tokens_tier)
            if o.kv_transfer_params is not None:
                st.kv_transfer_params = o.kv_transfer_params
            new_ids, new_lps = o.new_token_ids, o.new_logprobs
            # A token that finished the request by id (EOS / stop_token_ids) adds no text.
            text_ids = new_ids
            if o.finish_reason == "stop" and not isinstance(o.stop_reason, str):
                text_ids = text_ids[:-1]
                if isinstance(o.stop_reason, int) and st.params.include_stop_str_in_output:
                    text_ids = new_ids
            if len(text_ids) > 1 and s.detok.stop:
                # Several tokens in one step (accepted drafts): a stop string may end inside them, and
                # no token after the one that completes it may be output.
                stop_str = None
                for i, t in enumerate(text_ids):
                    stop_str = s.detok.add_tokens([t])
                    if stop_str is not None:
                        new_ids = new_ids[:i + 1]
                        new_lps = new_lps[:i + 1] if new_lps is not None else None
                        break
            else:
                stop_str = s.detok.add_tokens(text_ids)
            s.token_ids.extend(new_ids)
            if o.prompt_logprobs is not None and st.prompt_logprobs is None:
                st.prompt_logprobs = [None] + [self._logprob_entry(lp) for lp in o.prompt_logprobs]
            if new_lps is not None and s.logprobs is not None:
                for lp in new_lps:
                    s.logprobs.append(self._logprob_entry(lp))
                    s.cumulative_logprob = (s.cumulative_logprob or 0.0) + lp.logprob
            if stop_str is not None:
                s.finish_reason, s.stop_reason = "stop", stop_str
                to_abort.append(o.request_id)
            elif o.finish_reason is not None:
                s.finish_reason, s.stop_reason = o.finish_reason, o.stop_reason
            touched.setdefault(parent, set()).add(o.request_id)
        results = []
        for parent, kids in touched.items():
            st = self.requests[parent]
            results.append(self._make_output(st, kids, delta, now))
            if st.finished:
                self.requests.pop(parent, None)
                for cid in st.samples:
                    self.child_to_parent.pop(cid, None)
        return results, to_abort

    def _make_output(self, st: _RequestState, kids: set[str], delta: bool, now: float) -> RequestOutput:
        outs = []
        for cid, s in st.samples.items():
            if delta and cid not in kids:
                continue
            finished = s.finish_reason is not None
            if delta:
                text = s.detok.delta(finished)
                token_ids = s.token_ids[s.sent_tokens:]
                logprobs = s.logprobs[s.sent_logprobs:] if s.logprobs is not None else None
                s.sent_tokens = len(s.token_ids)
                s.sent_logprobs = len(s.logprobs or [])
            else:
                text, token_ids, logprobs = s.detok.text, list(s.token_ids), s.logprobs
            outs.append(CompletionOutput(s.index, text, token_ids, s.cumulative_logprob, logprobs,
                                         s.finish_reason, s.stop_reason))
        if st.finished:
            st.metrics.finished_time = now
        st.metrics.num_cached_tokens = st.num_cached_tokens
        kv_cost = None
        if st.finished:
            kvs = [s.kv for s in st.samples.values()]
            kv_cost = {"kv_block_seconds": sum(k[0] for k in kvs), "peak_kv_blocks": sum(k[1] for k in kvs),
                       "prefill_tokens_computed": sum(k[2] for k in kvs),
                       "prefill_tokens_cached": sum(k[3] for k in kvs)}
        prompt_lps = st.prompt_logprobs
        if delta:  # sent once, in the first delta that has them
            prompt_lps = None if st.prompt_logprobs_sent else prompt_lps
            st.prompt_logprobs_sent = st.prompt_logprobs_sent or prompt_lps is not None
        return RequestOutput(st.request_id, st.prompt, st.prompt_token_ids, outs, st.finished,
                             st.num_cached_tokens, st.metrics, kv_cost, st.prefix_cache, prompt_lps,
                             st.num_cached_tokens_tier, st.kv_transfer_params)
