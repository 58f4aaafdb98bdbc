"""Per-request block tables over a :class:`BlockPool`, with automatic prefix caching.

Each request owns a list of blocks (its *block table*, PagedAttention, Kwon et
al., SOSP 2023): logical block ``i`` holds the KV of tokens
``[i * block_size, (i + 1) * block_size)``.  Blocks are allocated on demand as
the scheduler grows a request's computed length, never reserved up front.

Prefix caching follows vLLM v1's automatic prefix caching: every *full* block
is identified by a chained hash of (parent block's hash, the block's tokens),
so a block's hash stands for the whole prefix ending at it.  When a block
becomes full its hash is registered in the pool; a new request walks its own
chain of hashes and reuses the longest run of leading registered blocks
instead of recomputing their KV.  Freed blocks keep their hashes until the
pool hands them out again (LRU eviction), so the cache costs no memory that
could otherwise be used.

Typical scheduler use, per step::

    # a waiting request (new, or resuming after preemption)
    hit_blocks, num_hit = kv.get_computed_blocks(rid, tokens)
    new = kv.allocate_slots(rid, tokens, num_hit, n, hit_blocks)
    # a running request
    new = kv.allocate_slots(rid, tokens, req.num_computed_tokens, n)
    # None -> not enough blocks: nothing changed; preempt someone or wait
    kv.free(rid)  # on finish, abort or preemption

Note: a block is registered as soon as the step that fills it is *scheduled*
(vLLM does the same).  A request scheduled later in the same step may therefore
hit it; this is correct as long as each layer writes the whole batch's new KV
into the cache before any sequence of the batch attends over it.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from typing import Sequence

import xxhash

from tinyvllm.core.block_pool import BlockPool, KVCacheBlock
from tinyvllm.core.kv_offload import OffloadIndex

__all__ = ["hash_block_tokens", "extend_block_hashes", "KVCacheManager", "PrefixCacheStats"]


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int], extra: object = None) -> int:
    """Chained 128-bit xxh3 hash of one full block.

    Args:
        parent_hash: hash of the previous block of the sequence, None for the first block.
        token_ids: the block's token ids (each must fit in a signed 64-bit int).
        extra: optional extra key (e.g. an adapter id) that must also match for a
            hit; it enters the hash through ``repr``, so it needs a deterministic repr.

    Equal prefixes give equal hashes, and a block's hash depends on every token
    before it.  The hash is deterministic across processes (no Python ``hash``).
    """
    h = xxhash.xxh3_128()
    if parent_hash is None:
        h.update(b"\x00")
    else:
        h.update(b"\x01" + parent_hash.to_bytes(16, "little"))
    if extra is not None:
        h.update(b"\x02" + repr(extra).encode())
    h.update(b"\x03")
    h.update(array("q", token_ids).tobytes())
    return h.intdigest()


def extend_block_hashes(hashes: list[int], token_ids: Sequence[int], block_size: int, num_full_blocks: int,
                        cache_salt: str | None = None) -> list[int]:
    """Extend ``hashes`` (the chained hashes of the first ``len(hashes)`` full blocks of ``token_ids``) in place
    to ``num_full_blocks`` blocks, and return it. ``cache_salt`` (vLLM's name) enters the first block's hash
    only; the chain carries it to the rest. The engine's prefix cache and the data-parallel router both hash
    prompts through this, so a router's "match" is a block the engine can reuse."""
    parent = hashes[-1] if hashes else None
    for i in range(len(hashes), num_full_blocks):
        parent = hash_block_tokens(parent, token_ids[i * block_size:(i + 1) * block_size],
                                   ("cache_salt", cache_salt) if i == 0 and cache_salt is not None else None)
        hashes.append(parent)
    return hashes


@dataclass
class PrefixCacheStats:
    """Prefix-cache counters over an interval (see :meth:`KVCacheManager.take_stats`).

    ``queries`` and ``hits`` are in tokens, like vLLM: tokens looked up and
    tokens found cached (in the pool or the offload tier).  ``tier_hits``: the
    part of ``hits`` found in the offload tier.  ``requests`` counts
    ``get_computed_blocks`` calls.  ``reset`` is True if the prefix cache was
    reset during the interval.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    reset: bool = False
    tier_hits: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCacheManager:
    """Allocates KV-cache blocks to requests and runs the prefix cache.

    Args:
        num_blocks: physical blocks in the KV cache (>= 1).
        block_size: tokens per block (>= 1).
        enable_caching: enable automatic prefix caching.
        offload: the KV offload tier's index (:mod:`tinyvllm.core.kv_offload`), or None. Blocks
            the pool evicts are stored there, and prefix lookups continue into it; the copies of
            a step are taken with :meth:`take_offload_ops`. Needs ``enable_caching``.

    Raises:
        ValueError: on non-positive sizes.

    Cumulative counters (tokens): ``prefix_cache_queries``, ``prefix_cache_hits``;
    ``prefix_cache_requests`` counts lookups.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 offload: OffloadIndex | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.offload = offload if enable_caching else None
        self.block_pool = BlockPool(num_blocks, enable_caching,
                                    on_evict=self.offload.prepare_store if self.offload is not None else None)
        # request id -> hashes found in the offload tier by its last lookup (loaded on its first allocation).
        self._tier_hits: dict[str, list[int]] = {}
        # request id -> its cache_salt (folded into its first block's hash).
        self.req_to_salt: dict[str, str] = {}
        # request id -> its block table (logical order).
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # request id -> hashes of its full blocks computed so far (a prefix of the chain).
        self.req_to_block_hashes: dict[str, list[int]] = {}
        # request id -> number of its leading blocks already offered to the cache.
        self.num_cached_blocks: dict[str, int] = {}
        self.prefix_cache_requests = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._interval = PrefixCacheStats()

    # -- hashing -------------------------------------------------------------

    def _block_hashes(self, request_id: str, token_ids: Sequence[int], num_full_blocks: int) -> list[int]:
        """The request's chained hashes, extended (incrementally) to ``num_full_blocks``."""
        return extend_block_hashes(self.req_to_block_hashes.setdefault(request_id, []), token_ids, self.block_size,
                                   num_full_blocks, self.req_to_salt.get(request_id))

    # -- scheduling API ------------------------------------------------------

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int],
                            cache_salt: str | None = None) -> tuple[list[KVCacheBlock], int]:
        """Prefix-cache lookup for a request that holds no blocks yet.

        Args:
            request_id: the request (its hashes are kept for ``allocate_slots``;
                call :meth:`free` when it finishes even if it never got blocks).
            token_ids: all currently known tokens (prompt, plus output so far
                when a preempted request resumes).
            cache_salt: the request's ``cache_salt``: folded into its first block's
                hash, so requests with different salts never share a block.

        Returns:
            ``(blocks, num_tokens)``: the longest run of leading full blocks found
            in the pool, and the tokens covered by them *and* by the blocks that
            continue the run in the offload tier (``num_tokens`` is a multiple of
            ``block_size``; :meth:`num_tier_hit_tokens` gives the tier's part).
            At least one token is always left uncached, since the last token must
            be computed to get logits.  No references are taken: pass the blocks
            to :meth:`allocate_slots` before any other allocation (it allocates
            the tier hits' blocks and schedules their loads).  Returns ``([], 0)``
            when caching is disabled.
        """
        if not self.enable_caching:
            return [], 0
        if cache_salt is not None:
            if self.req_to_salt.get(request_id) != cache_salt:
                self.req_to_block_hashes.pop(request_id, None)
            self.req_to_salt[request_id] = cache_salt
        bs = self.block_size
        max_hit_blocks = max(0, (len(token_ids) - 1) // bs)  # leave >= 1 token to compute
        hashes = self._block_hashes(request_id, token_ids, len(token_ids) // bs)
        hit: list[KVCacheBlock] = []
        for h in hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(h)
            if block is None:
                break
            hit.append(block)
        tier: list[int] = []
        if self.offload is not None:
            for h in hashes[len(hit):max_hit_blocks]:
                if h not in self.offload:
                    break
                self.offload.pin(h)  # this step's stores must not reuse its slot before the load
                tier.append(h)
        self._tier_hits[request_id] = tier
        num_hit_tokens = (len(hit) + len(tier)) * bs
        self.prefix_cache_requests += 1
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        self._interval.requests += 1
        self._interval.queries += len(token_ids)
        self._interval.hits += num_hit_tokens
        self._interval.tier_hits += len(tier) * bs
        return hit, num_hit_tokens

    def num_tier_hit_tokens(self, request_id: str) -> int:
        """Tokens of the request's last lookup found in the offload tier (not yet allocated)."""
        return len(self._tier_hits.get(request_id, ())) * self.block_size

    def take_offload_ops(self) -> tuple[list[tuple[int, int, str]], list[tuple[int, int]]]:
        """The offload copies prepared since the last call: ``(stores [(block_id, slot, hash hex)],
        loads [(slot, block_id)])`` (both empty without a tier). See :meth:`OffloadIndex.take_ops`."""
        if self.offload is None:
            return [], []
        return self.offload.take_ops()

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        new_computed_blocks: list[KVCacheBlock] | None = None,
        delay_cache_blocks: bool = False,
    ) -> list[KVCacheBlock] | None:
        """Make the request own blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        Args:
            request_id: the request.
            token_ids: all known tokens of the request (prompt + generated so far).
            num_computed_tokens: tokens whose KV already exists, *including* the
                tokens of ``new_computed_blocks``.
            num_new_tokens: tokens to compute in this step (>= 0).
            new_computed_blocks: prefix-cache hits from :meth:`get_computed_blocks`,
                only on the request's first allocation; they are referenced and
                become the head of its block table. The offload-tier hits of that
                lookup follow them: fresh blocks are allocated for them, registered
                under their hashes, and loaded from the tier before the step's forward.
            delay_cache_blocks: do not register the new full blocks in the prefix cache
                (vLLM's flag): their KV is loaded from another engine later; the
                request's next allocation registers them.

        Returns:
            The newly allocated blocks (possibly empty), or None if the pool has
            too few free blocks -- counting that reviving cached free blocks
            removes them from the pool.  On None nothing has changed.

        Every block that becomes full with tokens inside both
        ``token_ids`` and the first ``num_computed_tokens + num_new_tokens``
        tokens is registered in the prefix cache (when caching is enabled).

        Raises:
            ValueError: negative counts; computed blocks passed to a request that
                already holds blocks, or not covered by ``num_computed_tokens``;
                computed blocks that were evicted since the lookup.
        """
        if num_new_tokens < 0 or num_computed_tokens < 0:
            raise ValueError("token counts must be >= 0")
        bs = self.block_size
        blocks = self.req_to_blocks.get(request_id)
        hit = new_computed_blocks or []
        tier = self._tier_hits.get(request_id, []) if not blocks else []
        if tier and num_computed_tokens < (len(hit) + len(tier)) * bs:
            tier = []  # the caller does not count them as computed: compute them instead
        if hit:
            if blocks:
                raise ValueError(f"request {request_id!r} already holds blocks; "
                                 "computed blocks are only accepted on its first allocation")
            if num_computed_tokens < len(hit) * bs:
                raise ValueError("num_computed_tokens must include the computed blocks' tokens")
            hashes = self.req_to_block_hashes.get(request_id, [])
            if len(hashes) < len(hit) or any(b.block_hash != h for b, h in zip(hit, hashes)):
                raise ValueError("stale computed blocks: call get_computed_blocks again "
                                 "right before allocate_slots")
        num_held = len(blocks) if blocks else 0
        total_tokens = num_computed_tokens + num_new_tokens
        num_required = -(-total_tokens // bs)
        num_new_blocks = max(0, num_required - num_held - len(hit))
        num_revived = sum(1 for b in hit if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self.block_pool.get_num_free_blocks():
            return None

        # -- commit (nothing below can fail) --
        if blocks is None:
            blocks = self.req_to_blocks[request_id] = []
        if hit:
            self.block_pool.touch(hit)
            blocks.extend(hit)
            self.num_cached_blocks[request_id] = len(hit)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if tier:
            self._tier_hits.pop(request_id, None)
            for k, (block, h) in enumerate(zip(new_blocks, tier)):
                self.offload.prepare_load(h, block.block_id)
                if self.block_pool.cache_full_block(block, h) and self.block_pool.kv_events is not None:
                    self._record_stored(request_id, token_ids, len(hit) + k)
            self.num_cached_blocks[request_id] = len(hit) + len(tier)

        if self.enable_caching and not delay_cache_blocks:
            num_full = min(total_tokens, len(token_ids)) // bs
            start = self.num_cached_blocks.get(request_id, 0)
            if num_full > start:
                hashes = self._block_hashes(request_id, token_ids, num_full)
                for i in range(start, num_full):
                    if self.block_pool.cache_full_block(blocks[i], hashes[i]) and self.block_pool.kv_events is not None:
                        self._record_stored(request_id, token_ids, i)
                self.num_cached_blocks[request_id] = num_full
        return new_blocks

    def _record_stored(self, request_id: str, token_ids: Sequence[int], i: int) -> None:
        """A KV event: the request's block ``i`` was registered (its hash, its parent's, its tokens)."""
        hashes = self.req_to_block_hashes[request_id]
        bs = self.block_size
        self.block_pool.kv_events.append(("stored", hashes[i], hashes[i - 1] if i else None,
                                          list(token_ids[i * bs:(i + 1) * bs])))

    def free(self, request_id: str) -> None:
        """Release all of the request's blocks (tail first) and forget its hashes.

        Freed full blocks stay hittable until evicted.  Unknown ids are ignored,
        so calling it twice is harmless.
        """
        blocks = self.req_to_blocks.pop(request_id, None)
        self.req_to_block_hashes.pop(request_id, None)
        self.num_cached_blocks.pop(request_id, None)
        self._tier_hits.pop(request_id, None)
        self.req_to_salt.pop(request_id, None)
        if blocks:
            if self.offload is not None and self.offload.store_on_free:
                for block in blocks:  # head first: a tier too small for all keeps the shared prefix
                    if block.block_hash is not None:
                        self.offload.prepare_store(block.block_hash, block.block_id)
            self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        """Drop all cached content.  Returns False (no-op) while any block is owned."""
        ok = self.block_pool.reset_prefix_cache()
        if ok:
            self._interval.reset = True
            if self.offload is not None:
                self.offload.clear()
        return ok

    # -- queries -------------------------------------------------------------

    def get_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """The request's block table (empty if unknown).  Do not mutate."""
        return self.req_to_blocks.get(request_id, [])

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's block table as physical block ids (empty if unknown)."""
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def get_num_free_blocks(self) -> int:
        """Blocks not owned by any request (cached free blocks included)."""
        return self.block_pool.get_num_free_blocks()

    def num_owned_blocks(self) -> int:
        """Blocks with ref_cnt >= 1."""
        return self.num_blocks - self.block_pool.get_num_free_blocks()

    @property
    def usage(self) -> float:
        """Fraction of blocks owned, in [0, 1]."""
        return self.block_pool.get_usage()

    def take_stats(self) -> PrefixCacheStats:
        """Prefix-cache counters since the previous call (cumulative ones stay on ``self``)."""
        stats, self._interval = self._interval, PrefixCacheStats()
        return stats

    # -- debugging -----------------------------------------------------------

    def check_invariants(self) -> None:
        """Verify the bookkeeping; raises AssertionError describing the first violation.

        O(num_blocks + total block-table length): for tests and debug builds.
        Checks: the free queue is a well-linked list; a block is in it iff its
        ref_cnt is 0; ref_cnt equals the number of block-table entries holding
        the block; the hash map and the blocks' ``block_hash`` fields agree both
        ways; per-request cache bookkeeping is consistent.
        """
        def fail(msg: str) -> None:
            raise AssertionError(msg)

        pool = self.block_pool
        queue = pool.free_block_queue
        seen: set[int] = set()
        prev = queue._head
        for block in queue:
            if block.prev_free_block is not prev:
                fail(f"broken prev link at {block!r}")
            if block.block_id in seen:
                fail(f"{block!r} twice in the free queue")
            seen.add(block.block_id)
            prev = block
        if len(seen) != queue.num_free_blocks:
            fail(f"free queue holds {len(seen)} blocks, counter says {queue.num_free_blocks}")

        holders = [0] * self.num_blocks
        for rid, blocks in self.req_to_blocks.items():
            for block in blocks:
                holders[block.block_id] += 1
            if self.num_cached_blocks.get(rid, 0) > len(blocks):
                fail(f"request {rid!r}: more blocks cached than held")
        for block in pool.blocks:
            in_queue = block.block_id in seen
            if block.ref_cnt < 0:
                fail(f"negative ref_cnt: {block!r}")
            if in_queue != (block.ref_cnt == 0):
                fail(f"{block!r}: in free queue={in_queue} but ref_cnt={block.ref_cnt}")
            if not in_queue and (block.prev_free_block is not None or block.next_free_block is not None):
                fail(f"{block!r}: stale free-queue links")
            if block.ref_cnt != holders[block.block_id]:
                fail(f"{block!r} held by {holders[block.block_id]} block tables")
            if block.block_hash is not None and pool.cached_block_hash_to_block.get(block.block_hash) is not block:
                fail(f"{block!r} carries a hash that does not map to it")
        for h, block in pool.cached_block_hash_to_block.items():
            if block.block_hash != h:
                fail(f"hash {h:x} maps to {block!r}")
        for rid, blocks in self.req_to_blocks.items():
            hashes = self.req_to_block_hashes.get(rid, [])
            for i in range(self.num_cached_blocks.get(rid, 0)):
                h = blocks[i].block_hash
                if h is not None and (i >= len(hashes) or hashes[i] != h):
                    fail(f"request {rid!r} block {i}: cached under a hash not its own")
        if self.offload is not None:
            self.offload.check_invariants()
