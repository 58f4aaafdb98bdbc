"""The schedule of one step as plain data: what the scheduler hands the executor.

Everything here can cross a process boundary (msgspec structs of ints, lists
and :class:`~tinyvllm.sampling_params.SamplingParams`), so a worker in another
process (a tensor-parallel rank, a prefill worker) runs the step from this alone.
The split follows vLLM v1's ``SchedulerOutput``:

* a request scheduled for the first time travels whole, once, as
  :class:`NewRequestData` (its prompt, sampling parameters, EOS ids, blocks);
* afterwards only what changed: its token count this step, its new block ids,
  its ``num_computed_tokens`` (:class:`CachedRequestData`). The worker keeps the
  request's token history itself, appending each token it samples;
* a request resumed after a preemption is a cached request whose block table is
  replaced (``resumed_from_preemption``): its KV was dropped, its state was not;
* ``finished_req_ids``: requests that finished or were aborted since the last
  step, whose per-request state the worker drops.
"""

from __future__ import annotations

import msgspec

from tinyvllm.sampling_params import SamplingParams


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request's first schedule: everything the worker keeps of it.

    Attributes:
        req_id: engine request id.
        prompt_token_ids: the prompt, token ids.
        sampling_params: the request's sampling parameters.
        eos_token_ids: ids that end the request (banned before ``min_tokens``).
        block_ids: its whole block table after this step's allocation.
        num_computed_tokens: tokens whose KV is already in those blocks (prefix-cache hits).
    """

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int


class CachedRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """Requests the worker already knows, as parallel lists (one entry per request).

    Attributes:
        req_ids: engine request ids.
        resumed_from_preemption: True where the request was preempted and is back:
            ``new_block_ids`` is then its whole block table, replacing the old one.
        new_block_ids: block ids appended to the request's block table this step.
        num_computed_tokens: tokens with KV before this step.
    """

    req_ids: list[str] = []
    resumed_from_preemption: list[bool] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []


class SchedulerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One step's batch.

    Attributes:
        scheduled_new_reqs: requests scheduled for the first time.
        scheduled_cached_reqs: requests scheduled before (running or resumed).
        num_scheduled_tokens: request id -> tokens computed this step, in batch order.
        total_num_scheduled_tokens: their sum (<= ``max_num_batched_tokens``).
        num_prefill_tokens: prompt (or recomputed) tokens of this step.
        num_decode_tokens: requests computing exactly their newest output token.
        preempted_req_ids: requests preempted while building this step (KV freed).
        finished_req_ids: requests finished or aborted since the previous step.
        structured_output_request_ids: requests with a grammar that sample this step, in bitmask row order.
        grammar_bitmask: their next-token bitmask, int32 ``[len(structured_output_request_ids),
            ceil(vocab_size / 32)]`` (C order) as bytes; bit ``t % 32`` of word ``t // 32`` set = token
            ``t`` allowed (xgrammar's layout). Empty when no row is constrained.
        kv_offload_stores: ``(block_id, slot, block hash as 32 hex digits)`` copies from the KV pool to
            the offload tier, and
        kv_offload_loads: ``(slot, block_id)`` copies back; the worker runs all stores, then all
            loads, before the forward (:mod:`tinyvllm.core.kv_offload`).
        scheduled_spec_decode_tokens: request id -> its draft tokens this step (speculative decoding).
            Such a request's ``num_scheduled_tokens`` counts its last known token plus the drafts;
            the worker verifies them (:mod:`tinyvllm.spec_decode.rejection_sampler`). With a grammar,
            ``structured_output_request_ids`` names the request once per verified position
            (``len(drafts) + 1`` consecutive bitmask rows).
        num_spec_tokens: draft tokens of this step (part of ``total_num_scheduled_tokens``).
        kv_connector_metadata: the KV connector's instructions to its worker half this step, encoded by its
            scheduler half (:mod:`tinyvllm.distributed.kv_transfer`); empty when there is nothing to do.
    """

    scheduled_new_reqs: list[NewRequestData] = []
    scheduled_cached_reqs: CachedRequestData = msgspec.field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[str, int] = {}
    total_num_scheduled_tokens: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    preempted_req_ids: list[str] = []
    finished_req_ids: list[str] = []
    structured_output_request_ids: list[str] = []
    grammar_bitmask: bytes = b""
    kv_offload_stores: list[tuple[int, int, str]] = []
    kv_offload_loads: list[tuple[int, int]] = []
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    num_spec_tokens: int = 0
    kv_connector_metadata: bytes = b""

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens
