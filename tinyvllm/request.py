"""A request as the scheduler sees it: token ids, progress, and status.

It lives in the scheduler's process only; what the worker needs of it crosses in
the data-only :class:`~tinyvllm.scheduler_output.SchedulerOutput`, and the
worker keeps its own per-request sampling state (generators, token history).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from tinyvllm.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5
    WAITING_FOR_FSM = 6  # waiting, and its grammar is still compiling (vLLM's name)
    WAITING_FOR_REMOTE_KVS = 7  # waiting, and its KV blocks are being pulled from another engine (vLLM's name)

    @property
    def is_finished(self) -> bool:
        return RequestStatus.FINISHED_STOPPED <= self <= RequestStatus.FINISHED_ABORTED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort"}.get(self)


@dataclass
class Request:
    """One sequence being generated.

    Attributes:
        prompt_token_ids: the prompt, tokens.
        output_token_ids: tokens generated so far.
        num_computed_tokens: tokens whose KV is in this request's blocks. It only
            grows, except on preemption, where it returns to 0.
        num_cached_tokens: prompt tokens served from the prefix cache when the
            request was first scheduled (-1 until then).
        max_tokens: resolved output limit (tokens).
        prefix_cache_debug: build a prefix-cache report at first admission.
        prefix_cache_report: that report (a ``tinyvllm.metrics.kv_stats.PrefixCacheReport``), or None.
        kv_block_seconds: KV blocks held x seconds held, a block shared by k holders counting 1/k.
        peak_num_blocks: most blocks held at once.
        num_prefill_computed / num_prefill_cached: prompt (and recomputed) tokens computed, and served
            from the prefix cache, over all admissions (preemption recomputes).
        grammar: the request's grammar state (a ``tinyvllm.structured_output.RequestGrammar``) when it
            has ``structured_outputs``, else None; advanced by the scheduler with each sampled token.
        cache_salt: folded into the first block's hash (vLLM's field): requests share
            prefix-cached (and offloaded) blocks only with requests of the same salt.
        num_cached_tokens_tier: the part of ``num_cached_tokens`` loaded from the KV offload tier.
        spec_token_ids: draft tokens proposed for the next step (speculative decoding; empty: none).
            They are not part of ``all_token_ids`` until the model accepts them.
        num_new_output_tokens: output tokens appended by the last ``update_from_output`` (several
            when drafts were accepted).
        spec_acceptance: running estimate of the probability that one draft token is accepted
            (an exponential moving average over this request's verified drafts).
        kv_transfer_params_out: set by a KV connector when the request finishes: the ``kv_transfer_params``
            of its response (what another engine needs to pull its blocks).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    all_token_ids: list[int] = field(default_factory=list)
    prefix_cache_debug: bool = False
    prefix_cache_report: object | None = None
    kv_block_seconds: float = 0.0
    peak_num_blocks: int = 0
    num_prefill_computed: int = 0
    num_prefill_cached: int = 0
    grammar: Any = None
    cache_salt: str | None = None
    num_cached_tokens_tier: int = 0
    spec_token_ids: list[int] = field(default_factory=list)
    num_new_output_tokens: int = 0
    spec_acceptance: float | None = None
    kv_transfer_params_out: dict | None = None  # a KV connector's kv_transfer_params for the response

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)

    @property
    def kv_transfer_params(self) -> dict | None:
        """The request's ``kv_transfer_params`` (vLLM's P/D protocol, in ``sampling_params.extra_args``)."""
        extra = self.sampling_params.extra_args
        return extra.get("kv_transfer_params") if extra else None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Update ``status`` after a new token; True if the request just finished.

        Stops on EOS (unless ``ignore_eos``; never before ``min_tokens``), on a
        ``stop_token_ids`` hit, at ``max_tokens`` and at ``max_model_len``.
        Stop *strings* are handled by the output processor, which aborts.
        """
        sp = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and last in self.eos_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                return True
            if sp.stop_token_ids and last in sp.stop_token_ids:
                self.status = RequestStatus.FINISHED_STOPPED
                self.stop_reason = last
                return True
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH
            return True
        return False
