"""KV offload tier, scheduler half: which block hashes the tier holds, in which slot, in LRU order.

The device pool (:mod:`tinyvllm.core.block_pool`) is scarce; a second, larger
tier (host RAM, or a file on disk that survives restarts) keeps KV blocks that
the pool has evicted, keyed by the same chained block hash the prefix cache
uses (:func:`tinyvllm.core.kv_cache_manager.hash_block_tokens`). This module is
the tier's *index* only; its bytes live with the worker
(:mod:`tinyvllm.worker.kv_offload`), which executes the copies this index
decides. The split is vLLM v1's ``OffloadingManager`` (scheduler side:
``lookup`` / ``prepare_load`` / ``prepare_store``) versus its offloading
worker (read, not copied: vllm/v1/kv_offload/).

Policy: **store on evict** -- a block is copied to the tier when the pool hands
it out again while it still carries a hash (not write-through on every
computed block, so the tier is not a superset of the pool; see the vLLM
offloading PR discussion and SGLang's HiRadixCache "write_back" policy).
**Load on hit** -- :meth:`KVCacheManager.get_computed_blocks` continues the
request's hash chain into the tier after its pool hits; hits are copied into
freshly allocated pool blocks before the step's forward.

A disk tier also stores a request's blocks when the request is freed
(``store_on_free``), so a restart finds them.

Per step, the copies are returned by :meth:`OffloadIndex.take_ops` as
``(stores, loads)``; the worker runs every store before any load, and both
before the forward (a block handed out this step is overwritten by this step's
forward, and a load may target a block whose old content a store is saving).
A slot that a load of the current step reads, or that a store of the step
writes, is *pinned*: no (other) store of the same step may reuse it. Pins last
until :meth:`take_ops`.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

__all__ = ["OffloadIndex", "OffloadStats"]


class OffloadStats:
    """Cumulative tier counters (blocks): ``stored`` copies to the tier, ``loaded`` copies back,
    ``hits`` lookups that found a block (== loads scheduled), ``dropped_stores`` evictions that
    could not be stored (every slot pinned by this step's loads)."""

    __slots__ = ("stored", "loaded", "dropped_stores")

    def __init__(self) -> None:
        self.stored = 0
        self.loaded = 0
        self.dropped_stores = 0


class OffloadIndex:
    """LRU map ``block hash -> slot`` over ``num_slots`` slots of the offload tier.

    Args:
        num_slots: slots in the tier (>= 1); one slot holds one KV block of every layer.
        entries: ``(slot, block_hash)`` pairs already in the tier (a disk tier reopened after a
            restart), least recently used first.
        store_on_free: also store a request's cached blocks when it finishes (write-back at the end
            of a request, as well as on eviction): the disk tier's policy, so that what a session
            computed is on disk even if the server stops before the pool evicts it.

    Raises:
        ValueError: ``num_slots < 1``; an entry's slot out of range or given twice.
    """

    def __init__(self, num_slots: int, entries: Iterable[tuple[int, int]] = (), store_on_free: bool = False) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self.store_on_free = store_on_free
        # block hash -> slot, least recently used first.
        self._lru: OrderedDict[int, int] = OrderedDict()
        used: set[int] = set()
        for slot, h in entries:
            if not 0 <= slot < num_slots or slot in used:
                raise ValueError(f"bad offload entry: slot {slot}")
            if h in self._lru:  # the same block stored twice: keep the newer slot, free the older
                used.discard(self._lru.pop(h))
            used.add(slot)
            self._lru[h] = slot
        self._free_slots = [s for s in range(num_slots - 1, -1, -1) if s not in used]  # pop() -> lowest
        self._pinned: set[int] = set()
        self._stores: list[tuple[int, int, str]] = []  # (pool block id, slot, hash as 32 hex digits)
        self._loads: list[tuple[int, int]] = []  # (slot, pool block id)
        self.stats = OffloadStats()

    # -- queries -------------------------------------------------------------

    def __len__(self) -> int:
        """Blocks held by the tier."""
        return len(self._lru)

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._lru

    def lookup(self, block_hash: int) -> int | None:
        """The slot holding ``block_hash``, or None. Changes nothing."""
        return self._lru.get(block_hash)

    @property
    def usage(self) -> float:
        """Fraction of slots holding a block, in [0, 1]."""
        return len(self._lru) / self.num_slots

    # -- the copies of a step --------------------------------------------------

    def prepare_load(self, block_hash: int, block_id: int) -> None:
        """Copy the tier's block ``block_hash`` into pool block ``block_id`` before this step's forward.

        The slot becomes most recently used and is pinned until :meth:`take_ops`.

        Raises:
            KeyError: the tier does not hold ``block_hash``.
        """
        slot = self._lru[block_hash]
        self._lru.move_to_end(block_hash)
        self._pinned.add(slot)
        self._loads.append((slot, block_id))
        self.stats.loaded += 1

    def pin(self, block_hash: int) -> None:
        """Protect ``block_hash``'s slot from reuse until :meth:`take_ops` (between a lookup and its load)."""
        slot = self._lru.get(block_hash)
        if slot is not None:
            self._pinned.add(slot)

    def prepare_store(self, block_hash: int, block_id: int) -> bool:
        """Save pool block ``block_id`` (content ``block_hash``) before the pool reuses it.

        A hash the tier already holds is only marked most recently used (no copy). Otherwise a free
        slot is taken, or the least recently used unpinned slot is evicted. Returns whether the tier
        holds the block afterwards (False: every slot is pinned by this step's loads).
        """
        if block_hash in self._lru:
            self._lru.move_to_end(block_hash)
            return True
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            victim = next((h for h, s in self._lru.items() if s not in self._pinned), None)
            if victim is None:
                self.stats.dropped_stores += 1
                return False
            slot = self._lru.pop(victim)
        self._lru[block_hash] = slot
        self._pinned.add(slot)  # one write per slot per step: the worker's batched copy needs distinct slots
        self._stores.append((block_id, slot, f"{block_hash:032x}"))
        self.stats.stored += 1
        return True

    def take_ops(self) -> tuple[list[tuple[int, int, str]], list[tuple[int, int]]]:
        """The step's copies, ``(stores [(block_id, slot, block hash as 32 hex digits)], loads
        [(slot, block_id)])``, in order; clears them and the pins. (The hash travels as text: msgpack
        integers stop at 64 bits; a disk tier writes it into the slot's record.) The worker must run all stores, then all loads, before the forward."""
        ops = (self._stores, self._loads)
        self._stores, self._loads = [], []
        self._pinned.clear()
        return ops

    def clear(self) -> None:
        """Forget every block (a prefix-cache reset). Copies already prepared still run."""
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        self._lru.clear()

    # -- debugging -----------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if a slot is both free and used, used twice, or lost."""
        used = list(self._lru.values())
        if len(set(used)) != len(used):
            raise AssertionError("a tier slot holds two hashes")
        if set(used) & set(self._free_slots):
            raise AssertionError("a tier slot is both free and used")
        if len(used) + len(self._free_slots) != self.num_slots:
            raise AssertionError(f"tier slots lost: {len(used)} used + {len(self._free_slots)} free "
                                 f"!= {self.num_slots}")
