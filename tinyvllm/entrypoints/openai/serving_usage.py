"""The ``usage`` extensions: per-request KV cost (always) and the prefix-cache report (``prefix_cache_debug``).

``usage.kv_cost``: ``kv_block_seconds`` (KV blocks held x seconds held, a block
shared by k requests counting 1/k to each; summed over the ``n`` samples and the
prompts), ``peak_kv_blocks`` (sum over samples of each one's peak),
``prefill_tokens_computed`` (prompt tokens computed, recomputation after
preemption included) and ``prefill_tokens_cached`` (served from the prefix cache).

``usage.prefix_cache`` (one prompt; a list for a completions request with
several): ``reason``, ``matched_blocks`` / ``num_full_blocks``, ``block_size``,
``cached_tokens`` per tier (``pool``, and ``offload``: the KV offload tier's part) and, for ``prefix_changed``, ``diverged_at_token`` with the decoded text
around it: ``text_before`` (shared), ``text_after`` (this prompt) and
``previous_text_after`` (the earlier prompt). See :mod:`tinyvllm.metrics.kv_stats`.
"""

from __future__ import annotations

import logging
from typing import Any

from tinyvllm.outputs import RequestOutput

logger = logging.getLogger("tinyvllm.serving")

_KV_KEYS = ("kv_block_seconds", "peak_kv_blocks", "prefill_tokens_computed", "prefill_tokens_cached")


class UsageTracker:
    """Collects the KV cost and prefix-cache reports of a request's prompts as their outputs stream."""

    def __init__(self, num_prompts: int, tokenizer: Any, prefix_cache_debug: bool, request_id: str = "") -> None:
        self.kv: list[dict | None] = [None] * num_prompts
        self.reports: list[Any] = [None] * num_prompts
        self.tokenizer = tokenizer
        self.debug = prefix_cache_debug
        self.request_id = request_id

    def observe(self, prompt_index: int, out: RequestOutput) -> None:
        if out.kv_cost is not None:
            self.kv[prompt_index] = out.kv_cost
        if out.prefix_cache is not None:
            self.reports[prompt_index] = out.prefix_cache

    def _report(self, r: Any) -> dict:
        d: dict[str, Any] = {"reason": r.reason, "matched_blocks": r.matched_blocks,
                             "num_full_blocks": r.num_full_blocks, "block_size": r.block_size,
                             "cached_tokens": {"pool": r.cached_tokens, "offload": r.offloaded_tokens}}
        if r.diverged_at_token >= 0:
            dec = self.tokenizer.decode
            d.update(diverged_at_token=r.diverged_at_token, text_before=dec(r.common_token_ids),
                     text_after=dec(r.new_token_ids), previous_text_after=dec(r.previous_token_ids))
        return d

    def extend(self, usage: dict) -> dict:
        """Add ``kv_cost`` (and ``prefix_cache`` when asked) to an OpenAI usage dict; returns it."""
        usage["kv_cost"] = {k: sum(kv[k] for kv in self.kv if kv is not None) for k in _KV_KEYS}
        if self.debug:
            reports = [self._report(r) if r is not None else None for r in self.reports]
            usage["prefix_cache"] = reports[0] if len(reports) == 1 else reports
            for r in reports:
                if r is not None:
                    logger.info("prefix cache %s: %s, %d/%d blocks matched%s", self.request_id, r["reason"],
                                r["matched_blocks"], r["num_full_blocks"],
                                f", diverged at token {r['diverged_at_token']}" if "diverged_at_token" in r else "")
        return usage
