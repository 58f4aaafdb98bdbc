"""KV transfer between engines: the connector interface (:mod:`.base`, vLLM v1's ``KVConnectorBase_V1``) and
its implementations, chosen by ``--kv-transfer-config`` (``kv_connector``):

* ``ZmqConnector`` (:mod:`.zmq_connector`): prefill/decode disaggregation on vLLM's NIXL HTTP protocol
  (``kv_transfer_params``), so that vllm-router fronts tinyvllm engines; the KV bytes go over TCP (ZMQ).

How the KV offload tier relates: it stays a local tier of the KV cache manager (a lookup continues from the
pool into it). The scheduler's admission loop asks, in this order, the pool, the offload tier
(``KVCacheManager.get_computed_blocks``) and then the connector (``get_num_new_matched_tokens``) for the tokens
still missing; what none of them has is computed. That loop is the one place that decides where a block
comes from.
"""

from __future__ import annotations

from typing import Any

from tinyvllm.config import KVTransferConfig
from tinyvllm.distributed.kv_transfer.base import KVConnectorBase_V1, KVConnectorRole

__all__ = ["KVConnectorBase_V1", "KVConnectorRole", "create_kv_connector"]


def create_kv_connector(config: KVTransferConfig, role: KVConnectorRole, engine_info: dict[str, Any]
                        ) -> KVConnectorBase_V1:
    """The connector ``config.kv_connector`` names, as its ``role`` half.

    Raises:
        ValueError: bad connector options; the worker half cannot start (e.g. its port is taken).
    """
    if config.kv_connector == "ZmqConnector":
        from tinyvllm.distributed.kv_transfer.zmq_connector import ZmqConnector

        return ZmqConnector(config, role, engine_info)
    raise ValueError(f"unknown kv_connector {config.kv_connector!r}")  # config validation lists the known ones
