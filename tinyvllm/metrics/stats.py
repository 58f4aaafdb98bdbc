"""Typed engine statistics: what the engine core reports after each step.

Prometheus (:mod:`tinyvllm.metrics.prometheus`), ``LLM.stats()``, the benchmarks
and the dashboard read these by field. They are msgspec structs, so they travel
inside :class:`~tinyvllm.engine.messages.EngineCoreOutputs` unchanged.
"""

from __future__ import annotations

import msgspec


class SchedulerStats(msgspec.Struct, omit_defaults=True):
    """Scheduler state after a step: gauges (now) and cumulative counters (since start).

    Gauges:
        num_running: sequences in the running batch.
        num_waiting: sequences waiting to be scheduled (incl. preempted ones).
        kv_blocks_used: KV blocks owned by requests; ``kv_blocks_total`` in the pool.
    Counters (tokens unless named otherwise):
        num_steps: engine steps that scheduled something or nothing (every ``schedule()``).
        prefill_tokens: prompt (and recomputed) tokens computed.
        decode_tokens: decode tokens computed (one per decoding sequence per step).
        cached_prompt_tokens: prompt tokens served from the prefix cache at first admission.
        num_preemptions: preemptions (requests, not tokens).
        prefix_cache_queries / prefix_cache_hits: tokens looked up / found in the prefix cache.
        num_added: requests the engine core received (the API process's admission estimate).
        num_preempted (gauge): waiting sequences that were preempted (a subset of ``num_waiting``).
        kv_block_seconds: KV blocks owned x seconds (the sum of every request's ``kv_block_seconds``).
        prefix_cache_miss_reasons: prompts by prefix-cache miss reason at first admission
            (:mod:`tinyvllm.metrics.kv_stats`).
    KV offload tier (all zero without one):
        kv_offload_blocks_used / kv_offload_blocks_total: tier slots holding a block / all slots (gauges).
        kv_offload_stored_blocks / kv_offload_loaded_blocks: blocks copied pool -> tier / tier -> pool.
        kv_offload_hit_tokens: prompt tokens served from the tier (part of ``prefix_cache_hits``).
        kv_offload_block_bytes: bytes of one block (all layers, K and V): blocks x this = bytes copied.
        kv_offload_load_seconds: time spent copying blocks back from the tier (seconds, float).
    Speculative decoding (vLLM's names; all zero with it off):
        spec_decode_num_drafts: verification steps of a request with at least one draft token.
        spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens: draft tokens verified / accepted.
        spec_decode_num_accepted_tokens_per_pos: accepted drafts by position in the draft (0-based);
            ``spec_decode_num_draft_tokens_per_pos``: drafts that had that position (the draft length varies).
        spec_decode_propose_seconds: time the proposer took, summed (seconds, float).
    KV connector (P/D disaggregation; all zero without one):
        kv_transfer_recv_requests / kv_transfer_recv_bytes / kv_transfer_recv_seconds: requests whose prompt KV
            was pulled from another engine, the bytes, and the transfer time (seconds, float).
        kv_transfer_failed_requests: pulls that failed (those requests recomputed their prompt).
        kv_transfer_sent_requests: requests whose blocks another engine pulled (or released);
            kv_transfer_expired_requests: kept blocks freed because nobody pulled them within the TTL.
    """

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    num_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    cached_prompt_tokens: int = 0
    num_preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_added: int = 0
    num_preempted: int = 0
    kv_block_seconds: float = 0.0
    prefix_cache_miss_reasons: dict[str, int] = {}
    kv_offload_blocks_used: int = 0
    kv_offload_blocks_total: int = 0
    kv_offload_stored_blocks: int = 0
    kv_offload_loaded_blocks: int = 0
    kv_offload_hit_tokens: int = 0
    kv_offload_block_bytes: int = 0
    kv_offload_load_seconds: float = 0.0
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = []
    spec_decode_num_draft_tokens_per_pos: list[int] = []
    spec_decode_propose_seconds: float = 0.0
    kv_transfer_recv_requests: int = 0
    kv_transfer_recv_bytes: int = 0
    kv_transfer_recv_seconds: float = 0.0
    kv_transfer_failed_requests: int = 0
    kv_transfer_sent_requests: int = 0
    kv_transfer_expired_requests: int = 0

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of the pool's blocks owned by requests (0-1)."""
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    def as_dict(self) -> dict[str, int]:
        return msgspec.structs.asdict(self)


class IterationStats(msgspec.Struct, omit_defaults=True):
    """One step of the engine core.

    Attributes:
        num_prefill_tokens: prompt (or recomputed) tokens computed in the step.
        num_decode_tokens: sequences that computed exactly their newest output token.
        num_scheduled_reqs: sequences in the step's batch.
        num_preempted_reqs: sequences preempted while the step was built.
        step_seconds: wall time of schedule + forward + sampling + update (seconds).
        token_budget: the step's token budget (``max_num_batched_tokens``).
        kv_block_map: one byte per KV block (0 free, 1 cached-free, 2 owned; see
            :mod:`tinyvllm.metrics.kv_stats`), sent at most every ``BLOCK_MAP_INTERVAL_S``; empty otherwise.
    """

    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_scheduled_reqs: int = 0
    num_preempted_reqs: int = 0
    step_seconds: float = 0.0
    token_budget: int = 0
    kv_block_map: bytes = b""
