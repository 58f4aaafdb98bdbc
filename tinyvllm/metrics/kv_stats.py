"""Typed per-request KV statistics: the prefix-cache diagnosis and the names of the miss reasons.

The engine core builds a :class:`PrefixCacheReport` when a request asks for it
(``prefix_cache_debug``); it travels in
:class:`~tinyvllm.engine.messages.EngineCoreOutput` with token ids only (the
text is decoded in the API process, where the tokenizer lives).

Miss reasons (why a prompt's tokens were not all served from the prefix cache),
counted for every prompt at its first admission:

``partial_last_block``
    every cacheable block was a hit; only the last block's tokens were computed
    (a partial block is never cached, and the last token is always computed to
    get logits).
``cold``
    the first missing block was never seen (new content, or nothing matched).
``prefix_changed``
    the prompt matched a recently seen prompt for ``matched_blocks`` blocks and
    then differed from it, first at token ``diverged_at_token``.
``evicted``
    the first missing block had been cached and was dropped (LRU eviction or a
    prefix-cache reset).
``salted``
    reserved: the block would have hit under another ``cache_salt`` (needs
    cache salts, not in the engine yet).
``disabled``
    prefix caching is off (debug reports only; not counted).
"""

from __future__ import annotations

import msgspec

PARTIAL_LAST_BLOCK = "partial_last_block"
COLD = "cold"
PREFIX_CHANGED = "prefix_changed"
EVICTED = "evicted"
SALTED = "salted"
DISABLED = "disabled"
MISS_REASONS = (PARTIAL_LAST_BLOCK, COLD, PREFIX_CHANGED, EVICTED, SALTED)

# Block states in a KV block map (one byte per physical block, see IterationStats.kv_block_map).
BLOCK_FREE, BLOCK_CACHED_FREE, BLOCK_OWNED = 0, 1, 2


class PrefixCacheReport(msgspec.Struct, array_like=True, omit_defaults=True):
    """Why a prompt did or did not hit the prefix cache, at its first admission.

    Attributes:
        reason: one of the miss reasons above.
        num_full_blocks: full blocks in the prompt (``len(prompt) // block_size``).
        matched_blocks: leading blocks served from the cache.
        block_size: tokens per block.
        cached_tokens: tokens served from the in-pool prefix cache (``matched_blocks * block_size``).
        offloaded_tokens: tokens served from the KV offload tier (``--kv-offload-size``).
        diverged_at_token: ``prefix_changed``: index of the first prompt token that differs
            from the recently seen prompt; else -1.
        common_token_ids: up to 16 tokens just before the divergence (shared by both prompts).
        new_token_ids: up to 16 tokens of this prompt from the divergence on.
        previous_token_ids: up to 16 tokens of the earlier prompt from the divergence on.
    """

    reason: str
    num_full_blocks: int
    matched_blocks: int
    block_size: int
    cached_tokens: int
    offloaded_tokens: int = 0
    diverged_at_token: int = -1
    common_token_ids: list[int] = []
    new_token_ids: list[int] = []
    previous_token_ids: list[int] = []
