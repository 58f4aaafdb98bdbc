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

import time
from collections import deque
from typing import Callable

import msgspec

from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.kv_cache_manager import KVCacheManager
from tinyvllm.core.kv_diagnostics import PrefixCacheDiagnostics, kv_block_share
from tinyvllm.core.kv_offload import OffloadIndex
from tinyvllm.distributed.kv_transfer import KVConnectorBase_V1
from tinyvllm.metrics.stats import SchedulerStats
from tinyvllm.metrics.kv_stats import DISABLED, PrefixCacheReport
from tinyvllm.outputs import KVConnectorOutput
from tinyvllm.request import Request, RequestStatus
from tinyvllm.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput


class Scheduler:
    """Decides each step's batch. Owns the waiting queue, the running list and the KV cache manager.

    Its output is data (:class:`~tinyvllm.scheduler_output.SchedulerOutput`); the worker that runs
    it keeps its own per-request state, so the scheduler never shares a live object with it.

    ``clock`` (seconds, default ``time.monotonic``) times the KV cost: each request's blocks are charged
    ``share x (t_now - t_last)`` at every point where holdings may change (the start of ``schedule``,
    ``update_from_output`` and ``abort_requests``), so ``Request.kv_block_seconds`` is the exact integral
    of its block share (:func:`~tinyvllm.core.kv_diagnostics.kv_block_share`) over wall time.
    """

    def __init__(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig, num_blocks: int,
                 max_model_len: int, offload: OffloadIndex | None = None,
                 clock: Callable[[], float] = time.monotonic, connector: KVConnectorBase_V1 | None = None) -> None:
        self.config = scheduler_config
        self.cache_config = cache_config
        self.max_model_len = max_model_len
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                                 offload=offload)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.stats = SchedulerStats(kv_blocks_total=num_blocks)  # cumulative counters; gauges in make_stats
        # Static policy: how many requests of the current batch are still to be admitted.
        self._static_to_admit = 0
        # What the worker has been told: block ids sent per request (absent: never scheduled, or
        # preempted since), and the requests finished since the last schedule (the worker drops them).
        self._num_sent_blocks: dict[str, int] = {}
        self._known: set[str] = set()
        self._finished_ids: list[str] = []
        # KV cost and prefix-break diagnostics (tinyvllm/core/kv_diagnostics.py).
        self.clock = clock
        self._last_charge: float | None = None
        # request id -> (pool share_version, len(block table), share) of the last charge.
        self._kv_share: dict[str, tuple[int, int, float]] = {}
        self.num_preempted_waiting = 0
        self.prefix_diag = PrefixCacheDiagnostics(cache_config.block_size)
        if cache_config.enable_prefix_caching:
            self.kv.block_pool.on_hash_dropped = self.prefix_diag.on_evict
        # KV connector (scheduler half, P/D disaggregation): finished requests whose blocks are kept until the
        # worker half reports them sent (request id -> their blocks stay in ``self.kv`` under that id).
        self.connector = connector
        self._delayed_free: set[str] = set()

    # ------------------------------------------------------------------ queue ops
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def abort_requests(self, request_ids: list[str]) -> list[Request]:
        """Finish these requests as aborted and free their blocks at once; unknown ids are ignored."""
        self._charge_kv()
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
            if req.status == RequestStatus.PREEMPTED:
                self.num_preempted_waiting -= 1
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
        delay = False
        if self.connector is not None:
            delay, req.kv_transfer_params_out = self.connector.request_finished(
                req, self.kv.get_block_ids(req.request_id))
        if delay:  # another engine pulls them: freed when the connector says they were sent
            self._delayed_free.add(req.request_id)
        else:
            self.kv.free(req.request_id)
        self._kv_share.pop(req.request_id, None)
        self.requests.pop(req.request_id, None)
        self._num_sent_blocks.pop(req.request_id, None)
        if req.request_id in self._known:
            self._known.discard(req.request_id)
            self._finished_ids.append(req.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def has_pending_kv_transfers(self) -> bool:
        """True while a KV connector moves blocks (pulls in flight, finished requests' blocks kept for a pull)."""
        return bool(self._delayed_free) or (self.connector is not None and self.connector.has_pending())

    def update_from_kv_xfer_finished(self, out: KVConnectorOutput | None) -> bool:
        """Apply the KV connector's report (vLLM's ``_update_from_kv_xfer_finished``): free the kept blocks of
        requests whose blocks were sent (or expired); a request whose blocks arrived becomes schedulable with
        the prompt but its last token computed; one whose pull failed recomputes its prompt. Returns True if
        anything changed."""
        if not out:
            return False
        self.connector.update_connector_output(out)
        for rid in out.finished_sending:
            if rid in self._delayed_free:
                self._delayed_free.discard(rid)
                self.kv.free(rid)
        self.stats.kv_transfer_sent_requests += len(out.finished_sending) - out.num_expired
        self.stats.kv_transfer_expired_requests += out.num_expired
        self.stats.kv_transfer_recv_bytes += out.recv_bytes
        self.stats.kv_transfer_recv_seconds += out.recv_seconds
        for rid, ok in [(r, True) for r in out.finished_recving] + [(r, False) for r in out.failed_recving]:
            req = self.requests.get(rid)
            if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS:
                continue
            req.status = RequestStatus.WAITING
            if ok:
                self.stats.kv_transfer_recv_requests += 1
                req.num_computed_tokens = req.num_prompt_tokens - 1
            else:  # recompute: drop the blocks (never registered in the prefix cache) and start over
                self.stats.kv_transfer_failed_requests += 1
                self.kv.free(rid)
                req.num_computed_tokens = 0
        return True

    def make_stats(self) -> SchedulerStats:
        """A snapshot: the cumulative counters plus the current queue and KV gauges."""
        st = msgspec.structs.replace(self.stats, num_running=len(self.running), num_waiting=len(self.waiting),
                                     kv_blocks_used=self.kv.num_owned_blocks(),
                                     num_preempted=self.num_preempted_waiting,
                                     prefix_cache_miss_reasons=dict(self.stats.prefix_cache_miss_reasons),
                                     spec_decode_num_accepted_tokens_per_pos=list(
                                         self.stats.spec_decode_num_accepted_tokens_per_pos),
                                     spec_decode_num_draft_tokens_per_pos=list(
                                         self.stats.spec_decode_num_draft_tokens_per_pos))
        off = self.kv.offload
        if off is not None:
            st = msgspec.structs.replace(st, kv_offload_blocks_used=len(off), kv_offload_blocks_total=off.num_slots,
                                         kv_offload_stored_blocks=off.stats.stored,
                                         kv_offload_loaded_blocks=off.stats.loaded)
        return st

    # ------------------------------------------------------------------ KV cost, prefix diagnostics
    def _charge_kv(self) -> None:
        """Charge every running request its block share times the time since the last charge."""
        now = self.clock()
        last, self._last_charge = self._last_charge, now
        if last is None or now <= last or not self.running:
            return
        dt = now - last
        req_to_blocks = self.kv.req_to_blocks
        version = self.kv.block_pool.share_version
        cache = self._kv_share
        total = 0.0
        for req in self.running:
            rid = req.request_id
            blocks = req_to_blocks.get(rid)
            if not blocks:
                continue
            c = cache.get(rid)
            if c is not None and c[0] == version and c[1] <= len(blocks):
                share = c[2] + (len(blocks) - c[1])  # blocks added since are held by this request alone
            else:
                share = kv_block_share(blocks)
            cache[rid] = (version, len(blocks), share)
            req.kv_block_seconds += share * dt
            total += share * dt
        self.stats.kv_block_seconds += total

    def _diagnose_prefix(self, req: Request, num_cached: int) -> None:
        """Classify the request's first prefix-cache lookup (counted by reason); keep a report if asked."""
        if not self.kv.enable_caching or req.sampling_params.prompt_logprobs is not None:
            # No lookup (caching off, or prompt logprobs need every prompt position computed).
            if req.prefix_cache_debug:
                req.prefix_cache_report = PrefixCacheReport(DISABLED, req.num_tokens // self.block_size, 0,
                                                            self.block_size, 0)
            return
        hashes = self.kv.req_to_block_hashes.get(req.request_id, [])
        reason, report = self.prefix_diag.diagnose(hashes, req.all_token_ids, num_cached // self.block_size,
                                                   req.prefix_cache_debug)
        reasons = self.stats.prefix_cache_miss_reasons
        reasons[reason] = reasons.get(reason, 0) + 1
        if report is not None and req.num_cached_tokens_tier:  # matched blocks span pool and offload tier
            report.offloaded_tokens = req.num_cached_tokens_tier
            report.cached_tokens -= req.num_cached_tokens_tier
        req.prefix_cache_report = report
        self.prefix_diag.record_chain(hashes, req.all_token_ids)

    # ------------------------------------------------------------------ schedule
    def _start_remote_load(self, req: Request, computed_blocks: list, num_cached: int) -> bool | None:
        """Ask the KV connector for the tokens beyond the local hits; if it loads them asynchronously,
        allocate their blocks (not registered in the prefix cache until the request runs: their content is
        not there yet) and park the request as ``WAITING_FOR_REMOTE_KVS``. True if parked, False if the
        connector has nothing for it, None if there is no room for the blocks yet."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(req, num_cached)
        if not load_async or num_external <= 0:
            return False
        rid = req.request_id
        if self.kv.allocate_slots(rid, req.all_token_ids, num_cached, num_external, computed_blocks,
                                  delay_cache_blocks=True) is None:
            return None
        self.connector.update_state_after_alloc(req, self.kv.get_block_ids(rid), num_external)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        req.num_computed_tokens = num_cached
        if req.num_cached_tokens < 0:
            req.num_cached_tokens = num_cached
            self.stats.cached_prompt_tokens += num_cached
        return True

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        self._kv_share.pop(req.request_id, None)
        self._num_sent_blocks.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.stats.num_preemptions += 1
        self.num_preempted_waiting += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.append(req.request_id)
        if self.config.scheduling_policy == "static":
            self._static_to_admit += 1  # it rejoins its own batch

    def _emit(self, out: SchedulerOutput, req: Request, num_new: int) -> None:
        """Add ``req`` with ``num_new`` tokens to the step as data: whole the first time it is scheduled,
        as a change (token count, new block ids) afterwards, with its whole block table when resumed."""
        rid = req.request_id
        block_ids = self.kv.get_block_ids(rid)
        out.num_scheduled_tokens[rid] = num_new
        if rid not in self._known:
            self._known.add(rid)
            out.scheduled_new_reqs.append(NewRequestData(
                rid, list(req.prompt_token_ids), req.sampling_params, sorted(req.eos_token_ids), block_ids,
                req.num_computed_tokens))
        else:
            sent = self._num_sent_blocks.get(rid)
            cached = out.scheduled_cached_reqs
            cached.req_ids.append(rid)
            cached.resumed_from_preemption.append(sent is None)
            cached.new_block_ids.append(block_ids if sent is None else block_ids[sent:])
            cached.num_computed_tokens.append(req.num_computed_tokens)
        self._num_sent_blocks[rid] = len(block_ids)
        if len(block_ids) > req.peak_num_blocks:
            req.peak_num_blocks = len(block_ids)
        # A request is in "decode" when it computes exactly its newest output token (plus its drafts,
        # when it speculates: those count as spec tokens, neither prefill nor decode).
        num_draft = len(out.scheduled_spec_decode_tokens.get(rid, ())) if out.scheduled_spec_decode_tokens else 0
        if req.num_output_tokens > 0 and num_new - num_draft == 1 and req.num_computed_tokens + 1 == req.num_tokens:
            out.num_decode_tokens += 1
            out.num_spec_tokens += num_draft
        else:
            out.num_prefill_tokens += num_new
            req.num_prefill_computed += num_new
        out.total_num_scheduled_tokens += num_new

    def schedule(self) -> SchedulerOutput:
        self._charge_kv()
        cfg = self.config
        budget = cfg.max_num_batched_tokens
        out = SchedulerOutput(scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData([], [], [], []),
                              num_scheduled_tokens={}, preempted_req_ids=[], finished_req_ids=self._finished_ids)
        self._finished_ids = []
        scheduled = out.num_scheduled_tokens

        # 1) Running requests, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget,
                          self.max_model_len - req.num_computed_tokens)
            if num_new <= 0:
                i += 1
                continue
            # (drafts use only budget the running requests after this one do not need for one token each)
            drafts = (self._drafts_to_verify(req, num_new, budget - (len(self.running) - i - 1))
                      if req.spec_token_ids else None)
            if drafts:
                num_new += len(drafts)
            while True:
                blocks = self.kv.allocate_slots(req.request_id, req.all_token_ids, req.num_computed_tokens, num_new)
                if blocks is not None:
                    break
                if drafts:  # drafts never cost a preemption: without them the step may fit
                    num_new -= len(drafts)
                    drafts = []
                    continue
                victim = self.running[-1]  # most recently admitted
                if victim.request_id in scheduled:
                    # Never preempt a request already given tokens this step.
                    victim = None
                if victim is None or victim is req:
                    self._preempt(req, out)
                    req = None
                    break
                self._preempt(victim, out)
            if req is None:
                continue  # ``running[i]`` is now the next request
            if drafts:
                out.scheduled_spec_decode_tokens[req.request_id] = drafts
            self._emit(out, req, num_new)
            budget -= num_new
            i += 1

        # 2) Waiting requests.
        static = cfg.scheduling_policy == "static"
        if static and not self.running and self._static_to_admit <= 0:
            # The previous batch has fully finished (or never started): form the next one.
            # (Not while members of the current batch are still waiting to be admitted: one
            # that finished before the last was admitted must not open the batch to others.)
            self._static_to_admit = min(cfg.max_num_seqs, len(self.waiting))
        admit = not out.preempted_req_ids
        compiling: list[Request] = []  # WAITING_FOR_FSM: passed over (in order) until their grammar is ready
        while admit and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs:
            if static and self._static_to_admit <= 0:
                break
            req = self.waiting[0]
            if req.status in (RequestStatus.WAITING_FOR_FSM, RequestStatus.WAITING_FOR_REMOTE_KVS):
                compiling.append(self.waiting.popleft())
                continue
            if self.kv.get_blocks(req.request_id):  # its KV arrived from another engine: already in its blocks
                computed_blocks, num_cached = [], req.num_computed_tokens
            elif req.sampling_params.prompt_logprobs is not None:  # needs the logits of every prompt position
                computed_blocks, num_cached = [], 0  # (no lookup: it would pin and plan tier loads)
            else:
                computed_blocks, num_cached = self.kv.get_computed_blocks(req.request_id, req.all_token_ids,
                                                                          req.cache_salt)
            if self.connector is not None and not req.num_output_tokens:
                parked = self._start_remote_load(req, computed_blocks, num_cached)
                if parked is None:
                    break  # no room for its blocks yet
                if parked:
                    compiling.append(self.waiting.popleft())  # waits for its blocks, passed over like a compile
                    continue
            num_new = req.num_tokens - num_cached
            if not cfg.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            num_tier = self.kv.num_tier_hit_tokens(req.request_id)
            blocks = self.kv.allocate_slots(req.request_id, req.all_token_ids, num_cached, num_new,
                                            computed_blocks)
            if blocks is None:
                break
            self.stats.kv_offload_hit_tokens += num_tier
            self.waiting.popleft()
            if static:
                self._static_to_admit -= 1
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
                req.num_cached_tokens_tier = num_tier
                self.stats.cached_prompt_tokens += num_cached
                self._diagnose_prefix(req, num_cached)
            elif req.status == RequestStatus.PREEMPTED:
                self.num_preempted_waiting -= 1
            req.num_prefill_cached += num_cached
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._emit(out, req, num_new)
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

        out.kv_offload_stores, out.kv_offload_loads = self.kv.take_offload_ops()
        if self.connector is not None:
            out.kv_connector_metadata = self.connector.build_connector_meta()
        pc = self.kv.take_stats()
        self.stats.prefix_cache_queries += pc.queries
        self.stats.prefix_cache_hits += pc.hits
        self.stats.num_steps += 1
        self.stats.prefill_tokens += out.num_prefill_tokens
        self.stats.decode_tokens += out.num_decode_tokens
        return out

    def _drafts_to_verify(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The drafts of a decoding request that fit this step: a (1 + k)-token step over its cached
        context (its newest token and k drafts), k cut to the step's budget, to ``max_model_len``
        and to the output tokens ``max_tokens`` still allows (k + 1 tokens may be emitted)."""
        if num_new != 1 or req.num_computed_tokens + 1 != req.num_tokens:
            return []  # not decoding (a prefill chunk, or recomputing after a preemption)
        k = min(len(req.spec_token_ids), budget - 1, self.max_model_len - req.num_tokens - 1,
                req.max_tokens - req.num_output_tokens - 1)
        return req.spec_token_ids[:k] if k > 0 else []

    # ------------------------------------------------------------------ update
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int],
                           spec_accepted: dict[str, list[int]] | None = None) -> list[Request]:
        """Advance ``num_computed_tokens``, append sampled tokens, finish stopped requests.

        Args:
            out: the step's schedule.
            sampled: request id -> sampled token id, for requests whose step reached
                the end of their known tokens.
            spec_accepted: request id -> its accepted draft tokens (a prefix of its drafts in
                ``out.scheduled_spec_decode_tokens``), which come before ``sampled[rid]``. Rejected
                drafts are rolled back: ``num_computed_tokens`` counts only the accepted ones, so
                their KV slots are rewritten by a later step before anything reads them, and the
                prefix cache never hashes them (it hashes only blocks of known tokens).
        Returns:
            requests that got new tokens or finished this step (in schedule order);
            ``num_new_output_tokens`` says how many tokens each got.
        """
        self._charge_kv()
        touched = []
        spec = out.scheduled_spec_decode_tokens
        for rid, num_new in out.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None or req.status.is_finished:  # aborted mid-step
                continue
            drafts = spec.get(rid) if spec else None
            accepted = (spec_accepted or {}).get(rid, []) if drafts else []
            if drafts:
                req.spec_token_ids = []
                num_new -= len(drafts) - len(accepted)  # rejected positions are not computed
                self._count_spec(req, len(drafts), len(accepted))
            req.num_computed_tokens += num_new
            if rid not in sampled:
                continue
            req.num_new_output_tokens = 0
            for token in (*accepted, sampled[rid]):
                req.append_output_token(token)
                req.num_new_output_tokens += 1
                if req.grammar is not None and (not req.grammar.accept_token(token)
                                                or req.grammar.is_terminated()):
                    # The grammar accepted a stop token (EOS is only allowed where the output is complete),
                    # or (never with the bitmask applied) rejected the token: the request is done.
                    req.status = RequestStatus.FINISHED_STOPPED
                    self._finish(req)
                    break
                if req.check_stop(self.max_model_len):
                    self._finish(req)
                    break
            touched.append(req)
        return touched

    def _count_spec(self, req: Request, num_draft: int, num_accepted: int) -> None:
        """Speculative decoding counters (vLLM's names) and the request's acceptance estimate."""
        st = self.stats
        st.spec_decode_num_drafts += 1
        st.spec_decode_num_draft_tokens += num_draft
        st.spec_decode_num_accepted_tokens += num_accepted
        per_pos, drafted = st.spec_decode_num_accepted_tokens_per_pos, st.spec_decode_num_draft_tokens_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
            drafted.extend([0] * (num_draft - len(drafted)))
        for j in range(num_draft):
            drafted[j] += 1
        for j in range(num_accepted):
            per_pos[j] += 1
        # Per-token acceptance seen in this verification: accepted / tested (the first rejected
        # draft is tested too; those after it are not).
        tested = min(num_draft, num_accepted + 1)
        rate = num_accepted / tested
        a = req.spec_acceptance
        req.spec_acceptance = rate if a is None else 0.7 * a + 0.3 * rate
