"""KV cache events in vLLM's format, published over ZMQ PUB (``--kv-events-config``), so that a KV-aware
router (vllm-router's ``kv_aware`` policy with ``--kv-event-source``, llm-d's scheduler) can route on what
each replica's prefix cache really holds.

One message per engine step that changed the prefix cache: three frames, ``topic`` (bytes),
the sequence number (8 bytes, big-endian) and a msgpack :class:`KVEventBatch` ``[ts, [events...],
data_parallel_rank]``, each event a map tagged by ``type``: ``{"type": "BlockStored", "block_hashes",
"parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"}`` (a block registered in
the prefix cache: its hash, its parent's, its tokens), ``{"type": "BlockRemoved", "block_hashes", "medium"}``
(evicted: handed out again with its content gone), ``{"type": "AllBlocksCleared"}`` (the prefix cache was
reset): the layout vllm-router's ``kv_index`` decodes. Block hashes are tinyvllm's chained 128-bit xxh3
hashes as 32 big-endian bytes (consumers expect vLLM's 32-byte ``sha256_cbor`` hashes; they are opaque
ids there, tokens are matched by ``token_ids``). ``medium`` is ``"GPU"`` for the KV pool (vLLM's name for
the device tier, the only one a router accepts).

Source: vLLM ``vllm/distributed/kv_events.py`` (the structs and the ZMQ framing; read, not copied). The
replay socket of vLLM's publisher is not implemented.
"""

from __future__ import annotations

import time
from typing import Any, Union

import msgspec
import zmq

from tinyvllm.config import KVEventsConfig


class KVCacheEvent(msgspec.Struct, gc=False, tag=True, tag_field="type"):
    """Base of the events: msgpack maps tagged ``"type": <class name>``."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = "GPU"
    lora_name: str | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None = "GPU"


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: int | None = None


def _h(block_hash: int) -> bytes:
    return block_hash.to_bytes(32, "big")  # consumers take 32-byte hashes (vLLM's sha256 ones)


def to_events(raw: list[tuple[Any, ...]], block_size: int) -> list[KVCacheEvent]:
    """The KV cache manager's raw records (``("stored", hash, parent hash or None, token ids)``,
    ``("removed", hash)``, ``("cleared",)``) as vLLM's events, consecutive removals merged."""
    out: list[KVCacheEvent] = []
    for rec in raw:
        if rec[0] == "stored":
            out.append(BlockStored([_h(rec[1])], None if rec[2] is None else _h(rec[2]), list(rec[3]), block_size))
        elif rec[0] == "removed":
            if out and isinstance(out[-1], BlockRemoved):
                out[-1].block_hashes.append(_h(rec[1]))
            else:
                out.append(BlockRemoved([_h(rec[1])]))
        else:
            out.append(AllBlocksCleared())
    return out


class ZmqEventPublisher:
    """Binds a PUB socket at ``config.endpoint`` and publishes one :class:`KVEventBatch` per call.

    Raises:
        ValueError: the endpoint cannot be bound.
    """

    def __init__(self, config: KVEventsConfig) -> None:
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, config.hwm)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(config.endpoint)
        except zmq.ZMQError as e:
            self._sock.close()
            raise ValueError(f"kv_events_config: cannot bind {config.endpoint}: {e}") from None
        self._topic = config.topic.encode()
        self._seq = 0
        self._encoder = msgspec.msgpack.Encoder()

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        payload = self._encoder.encode(KVEventBatch(time.time(), events))
        try:
            self._sock.send_multipart([self._topic, self._seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:  # no subscriber keeps up (high-water mark): drop, as a PUB socket does
            pass
        self._seq += 1

    def shutdown(self) -> None:
        self._sock.close(0)
        self._ctx.term()
