"""Prefix-break diagnostics, per-request KV cost and the KV block map (data for usage, /metrics, the dashboard).

* :class:`PrefixCacheDiagnostics` keeps two bounded records -- the block-hash
  chains of the most recently admitted prompts (references to lists the KV cache
  manager and the request already own, no copy) and the most recently evicted
  block hashes -- and classifies each prompt's first prefix-cache miss (see
  :mod:`tinyvllm.metrics.kv_stats` for the reasons).  Because the hashes are
  chained, two chains that agree at block ``i`` agree on all of ``[0, i]``, so a
  chain is compared in O(1); classifying a prompt costs one dict lookup plus a
  scan of at most ``max_chains`` chains, once per request (not per step).
* :func:`kv_block_share` is a request's share of the blocks it holds: a block
  held by ``k`` requests counts ``1/k`` to each, so the shares of all holders
  sum to the number of owned blocks.  The scheduler integrates it over time
  (block-seconds, the KV-memory part of a request's cost).
* :func:`block_state_map` is one byte per physical block: free, cached-free
  (free but still holding a hash, so hittable) or owned.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from typing import Sequence

from tinyvllm.core.block_pool import BlockPool, KVCacheBlock
from tinyvllm.metrics.kv_stats import (BLOCK_CACHED_FREE, BLOCK_FREE, BLOCK_OWNED, COLD, EVICTED,
                                       PARTIAL_LAST_BLOCK, PREFIX_CHANGED, PrefixCacheReport)

__all__ = ["PrefixCacheDiagnostics", "kv_block_share", "block_state_map"]

_WINDOW = 16  # tokens of context on each side of a divergence


class PrefixCacheDiagnostics:
    """Bounded records of recent prompt chains and evicted hashes; classifies prefix-cache misses.

    Args:
        block_size: tokens per block.
        max_chains: prompts remembered (most recent first when searched).
        max_evicted: evicted block hashes remembered (LRU).
    """

    def __init__(self, block_size: int, max_chains: int = 256, max_evicted: int = 16384) -> None:
        self.block_size = block_size
        self.max_evicted = max_evicted
        # (block hashes, token ids) of recently admitted prompts; both lists are live references
        # (they keep growing while the request decodes), never copied.
        self.chains: deque[tuple[list[int], Sequence[int]]] = deque(maxlen=max_chains)
        self.evicted: OrderedDict[int, None] = OrderedDict()

    # -- recording (every request; O(1)) -----------------------------------------

    def record_chain(self, block_hashes: list[int], token_ids: Sequence[int]) -> None:
        """Remember a prompt's hash chain (by reference)."""
        if block_hashes:
            self.chains.append((block_hashes, token_ids))

    def on_evict(self, block_hash: int) -> None:
        """A cached block's hash left the pool (the block was handed out again, or the cache reset)."""
        ev = self.evicted
        ev[block_hash] = None
        ev.move_to_end(block_hash)
        if len(ev) > self.max_evicted:
            ev.popitem(last=False)

    # -- classification (once per request) ---------------------------------------

    def diagnose(self, block_hashes: Sequence[int], token_ids: Sequence[int], num_hit_blocks: int,
                 debug: bool = False) -> tuple[str, PrefixCacheReport | None]:
        """Classify a prompt's prefix-cache lookup.

        Args:
            block_hashes: the prompt's chained hashes, one per full block (at least
                ``len(token_ids) // block_size`` of them).
            token_ids: the prompt's tokens.
            num_hit_blocks: leading blocks that were served from the cache.
            debug: also build the :class:`PrefixCacheReport` (with token windows).

        Returns:
            ``(reason, report or None)``.
        """
        bs = self.block_size
        n = len(token_ids)
        num_full = n // bs
        max_hit = max(0, (n - 1) // bs)
        m = num_hit_blocks
        diverged, prev_tokens = -1, None
        if m >= max_hit:
            reason = PARTIAL_LAST_BLOCK
        else:
            h = block_hashes[m]
            if h in self.evicted:
                reason = EVICTED
            else:
                reason = COLD
                parent = block_hashes[m - 1] if m > 0 else None
                for chain, toks in reversed(self.chains):
                    if len(chain) <= m or (parent is not None and chain[m - 1] != parent):
                        continue  # shorter, or a different prefix
                    if chain[m] == h:  # the block was seen (and since dropped)
                        reason, prev_tokens = EVICTED, None
                        break
                    if parent is not None and prev_tokens is None:
                        reason, prev_tokens = PREFIX_CHANGED, toks  # the most recent one that diverges here
                if reason == PREFIX_CHANGED:
                    start = m * bs
                    off = next((i for i in range(bs) if token_ids[start + i] != prev_tokens[start + i]), 0)
                    diverged = start + off
        if not debug:
            return reason, None
        report = PrefixCacheReport(reason=reason, num_full_blocks=num_full, matched_blocks=m, block_size=bs,
                                   cached_tokens=m * bs)
        if diverged >= 0:
            report.diverged_at_token = diverged
            report.common_token_ids = list(token_ids[max(0, diverged - _WINDOW):diverged])
            report.new_token_ids = list(token_ids[diverged:diverged + _WINDOW])
            report.previous_token_ids = list(prev_tokens[diverged:diverged + _WINDOW])
        return reason, report


def kv_block_share(blocks: Sequence[KVCacheBlock]) -> float:
    """Blocks held, with a block shared by ``k`` holders counted ``1/k`` (units: blocks)."""
    share = 0.0
    for b in blocks:
        share += 1.0 if b.ref_cnt == 1 else 1.0 / b.ref_cnt
    return share


def block_state_map(pool: BlockPool) -> bytes:
    """One byte per physical block, by block id: ``BLOCK_FREE`` (0), ``BLOCK_CACHED_FREE`` (1) or
    ``BLOCK_OWNED`` (2); see :mod:`tinyvllm.metrics.kv_stats`.  O(num_blocks)."""
    return bytes([BLOCK_OWNED if b.ref_cnt else (BLOCK_FREE if b.block_hash is None else BLOCK_CACHED_FREE)
                  for b in pool.blocks])
