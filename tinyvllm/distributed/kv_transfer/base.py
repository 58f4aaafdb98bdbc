"""The KV connector interface, with vLLM v1's split and names (``KVConnectorBase_V1``).

A connector moves KV blocks between this engine and something outside it (another engine, for
prefill/decode disaggregation). One class, two instances: the **scheduler half** runs in the
engine core next to :class:`~tinyvllm.core.scheduler.Scheduler`, the **worker half** next to the
model runner's KV cache tensors (``role`` tells which). They talk only through the bytes of
:attr:`~tinyvllm.scheduler_output.SchedulerOutput.kv_connector_metadata` (scheduler -> worker, every
step) and :class:`~tinyvllm.outputs.KVConnectorOutput` (worker -> scheduler, every step), so the worker
half can live in another process.

Scheduler half (called by the scheduler):

* :meth:`get_num_new_matched_tokens` -- at admission, after the local lookup (prefix cache, then the
  KV offload tier, in :meth:`~tinyvllm.core.kv_cache_manager.KVCacheManager.get_computed_blocks`): how
  many more tokens can come from outside, and whether they arrive asynchronously. The admission loop
  is thus the one place that decides where a block comes from: pool, then offload tier, then connector,
  else computed.
* :meth:`update_state_after_alloc` -- the blocks that will receive those tokens were allocated.
* :meth:`build_connector_meta` -- at the end of ``schedule()``: what the worker half must do this step.
* :meth:`request_finished` -- a request finished; returning ``True`` delays the free of its blocks
  until the worker half reports it in ``finished_sending``.

Worker half (called by :class:`~tinyvllm.worker.worker.Worker` around ``execute_model``):

* :meth:`register_kv_caches` once; then per step :meth:`bind_connector_metadata`, :meth:`start_load_kv`
  (before the forward), :meth:`wait_for_layer_load` / :meth:`save_kv_layer` (per layer; no-ops for a
  connector that moves whole requests, like the P/D one), :meth:`wait_for_save` (after the forward),
  :meth:`get_finished` (requests whose sends / loads completed), :meth:`clear_connector_metadata`.

Source: vLLM ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (read, not copied).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from typing import Any

import torch

from tinyvllm.config import KVTransferConfig
from tinyvllm.outputs import KVConnectorOutput
from tinyvllm.request import Request

__all__ = ["KVConnectorBase_V1", "KVConnectorRole", "KVConnectorOutput"]


class KVConnectorRole(enum.Enum):
    SCHEDULER = 0
    WORKER = 1


class KVConnectorBase_V1(ABC):  # noqa: N801 - vLLM's name
    """Base of every KV connector (see the module docstring for the call order).

    Args:
        config: the parsed ``--kv-transfer-config``.
        role: which half this instance is.
        engine_info: facts the connector may need: ``block_size`` (tokens per block), ``fingerprint``
            (a string that two engines whose KV blocks are interchangeable share: model, dtype, KV
            layout), ``engine_id``.
    """

    def __init__(self, config: KVTransferConfig, role: KVConnectorRole, engine_info: dict[str, Any]) -> None:
        self.config = config
        self.role = role
        self.engine_info = engine_info

    # ------------------------------------------------------------------ scheduler half
    @abstractmethod
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens of ``request`` beyond its ``num_computed_tokens`` local hits that the connector can
        provide, and whether they are loaded asynchronously (the request then waits in
        ``WAITING_FOR_REMOTE_KVS`` until :meth:`get_finished` reports it)."""

    @abstractmethod
    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        """The request's block table (``block_ids``, physical ids, logical order) now covers its local hits
        plus ``num_external_tokens``; the connector plans their load."""

    @abstractmethod
    def build_connector_meta(self) -> bytes:
        """This step's instructions for the worker half, encoded (empty: nothing to do). Resets the
        scheduler half's per-step state."""

    @abstractmethod
    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """``request`` finished (or was aborted) holding ``block_ids``. Returns ``(delay_free, params)``:
        ``delay_free`` keeps the blocks owned until the worker half reports the request in
        ``finished_sending``; ``params`` are the ``kv_transfer_params`` of its response (or None)."""

    def has_pending(self) -> bool:
        """True while the scheduler half waits for the worker half (loads in flight, delayed frees)."""
        return False

    # ------------------------------------------------------------------ worker half
    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """The worker's KV cache tensors, one per layer, each with the block index as dimension 1
        (``[2, num_blocks, block_size, num_kv_heads, head_dim]`` today). A connector copies whole
        blocks of whatever these tensors hold (any dtype), so a quantized KV cache whose scales are
        further tensors of the same block layout travels the same way."""
        self.kv_caches = kv_caches

    def bind_connector_metadata(self, metadata: bytes) -> None:
        """This step's instructions from the scheduler half."""

    def start_load_kv(self) -> None:
        """Before the forward: start (or complete) the loads the metadata asks for."""

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until ``layer_name``'s KV is loaded (layer-wise connectors; no-op by default)."""

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any) -> None:
        """Start saving ``layer_name``'s KV (layer-wise connectors; no-op by default)."""

    def wait_for_save(self) -> None:
        """After the forward: block until this step's saves are done (no-op by default)."""

    def get_finished(self, finished_req_ids: set[str]) -> KVConnectorOutput:
        """Requests whose sends (blocks may now be freed) or loads (the request may now run) completed
        or failed since the last call. ``finished_req_ids``: requests the scheduler finished or aborted
        since the last step."""
        return KVConnectorOutput()

    def clear_connector_metadata(self) -> None:
        """End of the step."""

    def wait_for_transfers(self, timeout: float) -> None:
        """Nothing else to do this step: wait up to ``timeout`` seconds for a transfer to complete."""

    def shutdown(self) -> None:
        """Stop threads, close sockets."""
