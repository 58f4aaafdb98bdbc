"""Iteration-level scheduler: continuous batching, chunked prefill, prefix caching, preemption.

Every step the batch is rebuilt under a token budget (``max_num_batched_tokens``)
and a sequence limit (``max_num_seqs``), as in Orca (Yu et al., OSDI 2022) and
vLLM v1: running requests go first (a decode takes one token, a partial prefill
continues with the next chunk), then waiting requests are admitted while blocks
and budget allow. A request has no "phase": each step it is given
``num_new_tokens`` so that ``num_computed_tokens`` catches up with its known
tokens (prompt + output). When blocks run out, the most recently admitted
running request is preempted: its blocks are freed and it is recomputed later
from prompt + output so far (vLLM's recompute preemption).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    num_new_tokens: int      # tokens computed this step
    block_ids: list[int]     # the request's whole block table after allocation

    @property
    def samples(self) -> bool:
        """True if this step reaches the end of the known tokens, so its last logits are sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted: list[str] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    """Cumulative counters (tokens, requests, steps)."""

    num_steps: int = 0
    prefill_tokens: int = 0        # prompt (and recomputed) tokens computed
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    prefix_cache_queries: int = 0  # tokens looked up
    prefix_cache_hits: int = 0     # tokens hit


class Scheduler:
    """Decides each step's batch. Owns the waiting queue, the running list and the KV cache manager."""

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats()
        # Static policy: how many requests of the current batch are still to be admitted.
        self._static_to_admit = 0

    # ------------------------------------------------------------------ queue ops
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks at once; unknown ids are ignored."""
        aborted = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.status.is_finished:
                continue
            if self.config.scheduling_policy == "static" and req not in self.running:
                # The first ``_static_to_admit`` waiting requests are the current batch's
                # members still to admit; one of them leaving shrinks what is left to admit.
                if list(self.waiting).index(req) < self._static_to_admit:
                    self._static_to_admit -= 1
            req.status = RequestStatus.FINISHED_ABORTED
            self._finish(req)
            aborted.append(req)
        return aborted

    def _finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req.request_id)
        self.requests.pop(req.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ schedule
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted.append(req.request_id)
        if self.config.scheduling_policy == "static":
            self._static_to_admit += 1  # it rejoins its own batch

    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(scheduled=[])
        scheduled_ids: set[str] = set()

        # 1) Running requests, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget,
                          self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            while True:
                blocks = self.kv.allocate_slots(req.request_id, req.all_token_ids, req.num_computed_tokens, num_new)
                if blocks is not None:
                    break
                victim = self.running[-1]  # most recently admitted
                if victim.request_id in scheduled_ids:
                    # Never preempt a request already given tokens this step.
                    victim = None
                if victim is None or victim is req:
                    self._preempt(req, out)
                    req = None
                    break
                self._preempt(victim, out)
            if req is None:
                continue  # ``running[i]`` is now the next request
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.get_block_ids(req.request_id)))
            scheduled_ids.add(req.request_id)
            budget -= num_new
            i += 1

        # 2) Waiting requests.
        static = cfg.scheduling_policy == "static"
        if static and not self.running and self._static_to_admit <= 0:
            # The previous batch has fully finished (or never started): form the next one.
            # (Not while members of the current batch are still waiting to be admitted: one
            # that finished before the last was admitted must not open the batch to others.)
            self._static_to_admit = min(cfg.max_num_seqs, len(self.waiting))
        admit = not out.preempted
        while admit and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            if static and self._static_to_admit <= 0:
                break
            req = self.waiting[0]
            computed_blocks, num_cached = self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
            num_new = req.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            blocks = self.kv.allocate_slots(req.request_id, req.all_token_ids, num_cached, num_new,
                                            computed_blocks)
            if blocks is None:
                break
            self.waiting.popleft()
            if static:
                self._static_to_admit -= 1
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                self.stats.cached_prompt_tokens += num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_new, self.kv.get_block_ids(req.request_id)))
            scheduled_ids.add(req.request_id)
            budget -= num_new

        for s in out.scheduled:
            # A request is in "decode" when it computes exactly its newest output token.
            if s.request.num_output_tokens > 0 and s.num_new_tokens == 1 and s.samples:
                out.num_decode_tokens += 1
            else:
                out.num_prefill_tokens += s.num_new_tokens
        pc = self.kv.take_stats()
        self.stats.prefix_cache_queries += pc.queries
        self.stats.prefix_cache_hits += pc.hits
        self.stats.num_steps += 1
        self.stats.prefill_tokens += out.num_prefill_tokens
        self.stats.decode_tokens += out.num_decode_tokens
        return out

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish stopped requests.

        Args:
            out: the step's schedule.
            sampled: request id -> sampled token id, for requests whose step reached
                the end of their known tokens.
        Returns:
            requests that got a new token or finished this step (in schedule order).
        """
        touched = []
        for s in out.scheduled:
            req = s.request
            if req.status.is_finished:  # aborted mid-step
                continue
            req.num_computed_tokens += s.num_new_tokens
            if req.request_id not in sampled:
                continue
            req.append_output_token(sampled[req.request_id])
            if req.check_stop(self.max_model_len):
                self._finish(req)
            touched.append(req)
        return touched
