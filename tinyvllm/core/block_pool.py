"""Physical KV-cache blocks, their LRU free list and the prefix-cache hash map.

The KV cache is carved into ``num_blocks`` fixed-size blocks of ``block_size``
token slots each (PagedAttention, Kwon et al., SOSP 2023).  This module only
manages block *ids*; the tensors live in the model runner with layout
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` per layer, and token
``offset`` of block ``b`` is slot ``b * block_size + offset``.

A block is in exactly one of two states:

* **owned** -- ``ref_cnt >= 1`` (one per request holding it; a prefix-cache hit
  shares a block between requests);
* **free** -- ``ref_cnt == 0`` and linked into :class:`FreeKVCacheBlockQueue`.

A *full* block may additionally carry a ``block_hash`` (the chained hash of its
tokens, see :func:`tinyvllm.core.kv_cache_manager.hash_block_tokens`) and be
registered in the pool's hash -> block map.  A free block keeps its hash, so
its content can still be reused by a later request until the block is handed
out again and thereby evicted -- the automatic prefix caching scheme of vLLM v1.
The free queue is in eviction (LRU) order: blocks are reused from its head and
freed blocks go to its tail.
"""

from __future__ import annotations

import gc
from typing import Callable, Iterable, Iterator


class KVCacheBlock:
    """Metadata of one physical KV-cache block.

    Attributes:
        block_id: index of the block in the KV tensors, ``0 <= block_id < num_blocks``.
        ref_cnt: number of requests currently holding the block (0 = free).
        block_hash: chained hash of the block's ``block_size`` tokens while the
            block is registered in the prefix cache, else ``None``.
        prev_free_block / next_free_block: links of the free queue; both are
            ``None`` exactly when the block is not in the queue.
    """

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free_block: KVCacheBlock | None = None
        self.next_free_block: KVCacheBlock | None = None

    def __repr__(self) -> str:  # never follow the links: they form a cycle
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks in LRU eviction order.

    ``popleft`` takes the least recently freed block, ``append`` adds a block at
    the tail, ``remove`` unlinks a block anywhere (used when a prefix-cache hit
    revives a free block).  All three are O(1); two sentinel nodes remove the
    edge cases.  The blocks' own ``prev_free_block``/``next_free_block`` fields
    are the links, so no per-node allocation happens.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock] = ()) -> None:
        self._head = KVCacheBlock(-1)  # sentinel before the first free block
        self._tail = KVCacheBlock(-1)  # sentinel after the last free block
        self._head.next_free_block = self._tail
        self._tail.prev_free_block = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def __len__(self) -> int:
        return self.num_free_blocks

    def __iter__(self) -> Iterator[KVCacheBlock]:
        node = self._head.next_free_block
        while node is not self._tail:
            assert node is not None
            yield node
            node = node.next_free_block

    def popleft(self) -> KVCacheBlock:
        """Remove and return the head (next block to evict).  Raises ValueError if empty."""
        if self.num_free_blocks == 0:
            raise ValueError("no free blocks")
        block = self._head.next_free_block
        assert block is not None
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        """Link ``block`` at the tail (evicted last).  Raises ValueError if already queued."""
        if block.prev_free_block is not None or block.next_free_block is not None:
            raise ValueError(f"{block!r} is already in the free queue")
        last = self._tail.prev_free_block
        assert last is not None
        last.next_free_block = block
        block.prev_free_block = last
        block.next_free_block = self._tail
        self._tail.prev_free_block = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        """Unlink ``block`` from anywhere in the queue.  Raises ValueError if not queued."""
        prev, nxt = block.prev_free_block, block.next_free_block
        if prev is None or nxt is None:
            raise ValueError(f"{block!r} is not in the free queue")
        prev.next_free_block = nxt
        nxt.prev_free_block = prev
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        """The free blocks from head (evicted first) to tail.  O(n); for tests and debugging."""
        return list(self)


class BlockPool:
    """All ``num_blocks`` blocks, the free queue and the prefix-cache map.

    Args:
        num_blocks: number of physical blocks (>= 1).  Block 0 is an ordinary block.
        enable_caching: when False, ``cache_full_block`` is a no-op and no hash
            is ever kept.
        on_evict: called as ``on_evict(block_hash, block_id)`` when a block that still
            carries a hash is handed out again (its content is about to be overwritten):
            the KV offload tier's store-on-evict hook (:mod:`tinyvllm.core.kv_offload`).

    Raises:
        ValueError: ``num_blocks < 1``.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True,
                 on_evict: Callable[[int, int], object] | None = None) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # The garbage collector is paused while the blocks are made: creating N objects otherwise runs
        # ~N/700 young collections whose promotions trigger full collections over the whole heap (torch,
        # transformers), 2-3 s for the 262,144 blocks of a tiny model's 1 GiB budget (0.3 s with it paused).
        # Only paused, not skipped: the blocks live as long as the pool, and later collections see them.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
            self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        finally:
            if gc_was_enabled:
                gc.enable()
        # block hash -> the one block registered under it (owned or free).
        self.cached_block_hash_to_block: dict[int, KVCacheBlock] = {}
        self.on_evict = on_evict
        # Called with each hash that leaves the cache (eviction or reset); prefix-break diagnostics.
        self.on_hash_dropped: Callable[[int], None] | None = None
        # KV events (--kv-events-config): raw records of prefix-cache changes, taken by the engine core.
        self.kv_events: list[tuple] | None = None
        # Bumped whenever a block gains a second holder or a shared block loses one, so the per-request
        # KV share (tinyvllm.core.kv_diagnostics.kv_block_share) is only recomputed when it may change.
        self.share_version = 0

    # -- allocation ----------------------------------------------------------

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Take ``num_blocks`` blocks from the head of the free queue, ref_cnt 1 each.

        A taken block that still held cached content is evicted: its hash leaves
        the map and is cleared.  Raises ValueError if fewer blocks are free
        (nothing is taken then).
        """
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(
                f"cannot allocate {num_blocks} blocks: only "
                f"{self.free_block_queue.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_block_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached_block_hash_to_block.get(block.block_hash) is block:
                del self.cached_block_hash_to_block[block.block_hash]
                if self.on_evict is not None:
                    self.on_evict(block.block_hash, block.block_id)
                if self.on_hash_dropped is not None:
                    self.on_hash_dropped(block.block_hash)
                if self.kv_events is not None:
                    self.kv_events.append(("removed", block.block_hash))
            block.block_hash = None

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block, in the given order.

        Blocks reaching ref_cnt 0 are appended to the free-queue tail and keep
        their hash (still hittable).  Callers pass a request's blocks in
        *reverse* order so that the tail of a sequence is evicted before its
        head, which is the part other requests are most likely to share.
        Raises ValueError on a block that is already free.
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"{block!r} is already free")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
            else:
                self.share_version += 1

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take one more reference on each block (a prefix-cache hit).

        A free block is revived: it leaves the free queue without being evicted.
        """
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            else:
                self.share_version += 1
            block.ref_cnt += 1

    # -- prefix cache --------------------------------------------------------

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        """The block registered under ``block_hash`` (owned or free), or None."""
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register a full, owned block under ``block_hash``; return whether it is now cached.

        If another block is already registered under the hash (the same content
        was computed twice concurrently) the existing mapping wins and
        ``block`` stays uncached.  Re-registering a block under its own hash is
        a no-op.  Raises ValueError if the block is free or is already cached
        under a different hash.
        """
        if not self.enable_caching:
            return False
        if block.ref_cnt == 0:
            raise ValueError(f"cannot cache free block {block!r}")
        if block.block_hash is not None:
            if block.block_hash != block_hash:
                raise ValueError(f"{block!r} is already cached under another hash")
            return True
        if block_hash in self.cached_block_hash_to_block:
            return False
        block.block_hash = block_hash
        self.cached_block_hash_to_block[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash.  Only allowed when no block is owned.

        Returns False (and changes nothing) if some block is in use, else True.
        """
        if self.free_block_queue.num_free_blocks != self.num_blocks:
            return False
        for block in self.cached_block_hash_to_block.values():
            if self.on_hash_dropped is not None:
                self.on_hash_dropped(block.block_hash)
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        if self.kv_events is not None:
            self.kv_events.append(("cleared",))
        return True

    # -- accounting ----------------------------------------------------------

    def get_num_free_blocks(self) -> int:
        """Blocks with ref_cnt 0 (including free blocks that still hold cached content)."""
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        """Fraction of blocks owned by some request, in [0, 1]."""
        return 1.0 - self.free_block_queue.num_free_blocks / self.num_blocks
