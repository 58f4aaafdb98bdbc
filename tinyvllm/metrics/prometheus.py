"""Prometheus metrics of the API server (vLLM's metric set under the ``tinyvllm:`` prefix).

Per-request latencies (TTFT, inter-token latency, end-to-end) and token counters
are recorded in the API process from the request outputs as they stream; the
scheduler gauges (running / waiting requests, KV cache usage) and the preemption
and prefix-cache counters come from the engine core's stats snapshot, which the
core sends after every step (and after aborts). Each server owns its own
:class:`~prometheus_client.CollectorRegistry`, so several servers (or tests) in
one process never collide.
"""

from __future__ import annotations

import hashlib
import time
import types
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from tinyvllm.metrics.kv_stats import MISS_REASONS
from tinyvllm.metrics.stats import SchedulerStats
from tinyvllm.outputs import RequestOutput

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0)
_ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0, 1920.0)

CONTENT_TYPE = CONTENT_TYPE_LATEST
# The families fed by the engine cores' stats (one child per engine core; labelled engine="i" with several).
_ENGINE_FAMILIES = ("preemptions", "prefix_queries", "prefix_hits", "running", "waiting", "kv_usage", "kv_used",
                    "kv_total", "kv_block_seconds", "preempted", "offload_stored", "offload_loaded",
                    "offload_stored_bytes", "offload_loaded_bytes", "offload_hits", "offload_load_seconds",
                    "offload_usage", "offload_used", "offload_total", "spec_drafts", "spec_draft_tokens",
                    "spec_accepted_tokens", "spec_propose_seconds")
MAX_USER_LABELS = 256  # distinct ``user`` label values; later users are counted under "other"
MAX_LABEL_BYTES = 64  # a client-given label value longer than this (UTF-8 bytes) is cut, see bounded_label
_LABEL_PREFIX_BYTES = MAX_LABEL_BYTES - 13  # ... to a prefix of at most this many bytes, "~" and 12 hex digits


def kv_cache_dtype_label(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV dtype a ``--kv-cache-dtype`` value stores: ``auto`` is the model's dtype, ``fp8`` is ``fp8_e4m3``."""
    kv = str(kv_cache_dtype).lower()
    return model_dtype if kv == "auto" else {"fp8": "fp8_e4m3"}.get(kv, kv)


def bounded_label(value: str) -> str:
    """``value`` as a Prometheus label value of at most :data:`MAX_LABEL_BYTES` UTF-8 bytes: unchanged if it
    fits, else its longest prefix of at most 51 bytes (whole characters), ``~`` and the first 12 hex digits
    of its SHA-256, so that long values stay readable and distinct (``/metrics`` then stays bounded: at most
    :data:`MAX_USER_LABELS` + 1 user values of at most 64 bytes each, 128 once escaped)."""
    raw = value.encode("utf-8", "replace")  # (a lone surrogate, which the API refuses anyway, becomes "?")
    if len(raw) <= MAX_LABEL_BYTES:
        return raw.decode("utf-8")
    prefix = raw[:_LABEL_PREFIX_BYTES].decode("utf-8", "ignore")  # a cut multi-byte character is dropped
    return f"{prefix}~{hashlib.sha256(raw).hexdigest()[:12]}"


@dataclass
class _ReqState:
    arrival: float
    last_token_time: float | None = None
    counted_prompt: bool = False
    user: str = ""


class ServerMetrics:
    """The server's metric families plus the per-request bookkeeping that feeds them."""

    def __init__(self, model_name: str, num_engines: int = 1) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r, lab = self.registry, ["model_name"]
        # With data parallelism the families the engine cores' stats feed carry vLLM's engine="i" label.
        lab_e = lab + (["engine"] if num_engines > 1 else [])
        self.model_name = model_name
        self.num_engines = num_engines
        self.ttft = Histogram("tinyvllm:time_to_first_token_seconds", "Time to first token (seconds).", lab,
                              buckets=_TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("tinyvllm:inter_token_latency_seconds",
                             "Time between successive output chunks of a request, per token (seconds).", lab,
                             buckets=_ITL_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("tinyvllm:e2e_request_latency_seconds", "End-to-end request latency (seconds).",
                             lab, buckets=_E2E_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("tinyvllm:prompt_tokens", "Prefilled prompt tokens.", lab,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("tinyvllm:generation_tokens", "Generated tokens.", lab,
                                         registry=r).labels(model_name)
        self.cached_tokens = Counter("tinyvllm:prompt_tokens_cached",
                                     "Prompt tokens served from the prefix cache.", lab,
                                     registry=r).labels(model_name)
        self._success = Counter("tinyvllm:request_success", "Requests finished, by finish reason.",
                                lab + ["finished_reason"], registry=r)
        self.preemptions = Counter("tinyvllm:num_preemptions", "Preemptions (KV cache exhausted).", lab_e,
                                   registry=r)
        self.prefix_queries = Counter("tinyvllm:prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                      "cache.", lab_e, registry=r)
        self.prefix_hits = Counter("tinyvllm:prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                                   lab_e, registry=r)
        self.running = Gauge("tinyvllm:num_requests_running", "Sequences in the running batch.", lab_e,
                             registry=r)
        self.waiting = Gauge("tinyvllm:num_requests_waiting", "Sequences waiting to be scheduled.", lab_e,
                             registry=r)
        self.kv_usage = Gauge("tinyvllm:kv_cache_usage_perc", "Fraction of KV cache blocks in use (0-1).", lab_e,
                              registry=r)
        self.kv_used = Gauge("tinyvllm:kv_cache_used_blocks", "KV cache blocks in use.", lab_e,
                             registry=r)
        self.kv_total = Gauge("tinyvllm:kv_cache_total_blocks", "KV cache blocks in the pool.", lab_e,
                              registry=r)
        # vLLM's cache_config_info (the same label names): the KV pool's shape, constant 1.
        self.cache_info = Gauge("tinyvllm:cache_config_info", "The KV cache's configuration (labels; value 1).",
                                ["block_size", "cache_dtype", "num_gpu_blocks"], registry=r)
        self.kv_block_seconds = Counter("tinyvllm:kv_block_seconds", "KV blocks held x seconds held, all "
                                        "requests (a shared block counts 1/k to each of k holders).", lab_e,
                                        registry=r)
        self.preempted = Gauge("tinyvllm:num_requests_preempted", "Waiting sequences that were preempted.", lab_e,
                               registry=r)
        self._miss_reason = Counter("tinyvllm:prefix_cache_miss_reason", "Prompts by why their uncached tokens "
                                    "missed the prefix cache (partial_last_block: all cacheable blocks hit).",
                                    lab_e + ["reason"], registry=r)
        lab_user = ["model_name", "user"]
        self._user_kv = Counter("tinyvllm:user_kv_block_seconds", "KV block-seconds of finished requests, per "
                                "request `user`.", lab_user, registry=r)
        self._user_prefill = Counter("tinyvllm:user_prefill_tokens_computed", "Prefill tokens computed for "
                                     "finished requests, per request `user`.", lab_user, registry=r)
        self._user_cached = Counter("tinyvllm:user_prefill_tokens_cached", "Prefill tokens served from the "
                                    "prefix cache for finished requests, per request `user`.", lab_user, registry=r)
        self._user_requests = Counter("tinyvllm:user_requests", "Finished requests, per request `user`.",
                                      lab_user, registry=r)
        self._users: set[str] = set()
        # KV offload tier (vLLM has no fixed names for these; ours follow its kv_cache_* ones).
        self.offload_stored = Counter("tinyvllm:kv_offload_stored_blocks", "KV blocks copied pool -> offload tier.",
                                      lab_e, registry=r)
        self.offload_loaded = Counter("tinyvllm:kv_offload_loaded_blocks", "KV blocks copied offload tier -> pool.",
                                      lab_e, registry=r)
        self.offload_stored_bytes = Counter("tinyvllm:kv_offload_stored_bytes", "Bytes copied to the offload tier.",
                                            lab_e, registry=r)
        self.offload_loaded_bytes = Counter("tinyvllm:kv_offload_loaded_bytes", "Bytes copied from the offload tier.",
                                            lab_e, registry=r)
        self.offload_hits = Counter("tinyvllm:kv_offload_hit_tokens", "Prompt tokens served from the offload tier "
                                    "(part of prefix_cache_hits).", lab_e, registry=r)
        self.offload_load_seconds = Counter("tinyvllm:kv_offload_load_seconds", "Time copying blocks back from the "
                                            "offload tier (seconds).", lab_e, registry=r)
        self.offload_usage = Gauge("tinyvllm:kv_offload_usage_perc", "Fraction of offload-tier slots holding a block "
                                   "(0-1).", lab_e, registry=r)
        self.offload_used = Gauge("tinyvllm:kv_offload_used_blocks", "Offload-tier slots holding a block.", lab_e,
                                  registry=r)
        self.offload_total = Gauge("tinyvllm:kv_offload_total_blocks", "Offload-tier slots.", lab_e,
                                   registry=r)
        # Speculative decoding: vLLM's names (vllm:spec_decode_*), our prefix.
        self.spec_drafts = Counter("tinyvllm:spec_decode_num_drafts", "Verification steps of a request with "
                                   "draft tokens.", lab_e, registry=r)
        self.spec_draft_tokens = Counter("tinyvllm:spec_decode_num_draft_tokens", "Draft tokens verified.", lab_e,
                                         registry=r)
        self.spec_accepted_tokens = Counter("tinyvllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                                            lab_e, registry=r)
        self._spec_per_pos = Counter("tinyvllm:spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                                     "by position in the draft (0-based).", lab_e + ["position"], registry=r)
        self.spec_propose_seconds = Counter("tinyvllm:spec_decode_propose_seconds", "Time the draft proposer "
                                            "took (seconds).", lab_e, registry=r)
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name, reason)
        self._requests: dict[str, _ReqState] = {}
        # Per engine core: the label values of its series, its children of the families above, and the last
        # cumulative counters it reported (the counters grow by the difference).
        self._engine_labels = [(model_name,) + ((str(e),) if num_engines > 1 else ()) for e in range(num_engines)]
        self._eng = [types.SimpleNamespace(**{name: getattr(self, name).labels(*lv) for name in _ENGINE_FAMILIES})
                     for lv in self._engine_labels]
        for lv in self._engine_labels:
            for reason in MISS_REASONS:
                self._miss_reason.labels(*lv, reason)
        self._last: list[dict[str, float]] = [{} for _ in range(num_engines)]

    def set_cache_config(self, block_size: int, cache_dtype: str, num_blocks: int) -> None:
        """Publish the KV pool's configuration as ``tinyvllm:cache_config_info`` (vLLM's labels: ``block_size``
        tokens per block, ``cache_dtype`` the resolved KV dtype, ``num_gpu_blocks`` blocks per engine core)."""
        self.cache_info.labels(block_size=str(block_size), cache_dtype=cache_dtype,
                               num_gpu_blocks=str(num_blocks)).set(1)

    # -------------------------------------------------------------- per request
    def request_added(self, request_id: str, arrival: float, user: str | None = None) -> None:
        self._requests[request_id] = _ReqState(arrival, user=bounded_label(user or ""))

    def request_aborted(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    @property
    def num_tracked_requests(self) -> int:
        """Requests whose timing state is held (added, not yet finished or aborted)."""
        return len(self._requests)

    def record_output(self, out: RequestOutput, now: float | None = None) -> None:
        """Account one (delta) output of a request: its new tokens, and TTFT/ITL/E2E timings."""
        st = self._requests.get(out.request_id)
        if st is None:
            return
        now = time.monotonic() if now is None else now
        new_tokens = sum(len(c.token_ids) for c in out.outputs)
        if new_tokens:
            if st.last_token_time is None:
                self.ttft.observe(max(0.0, now - st.arrival))
            else:  # a delta may carry several tokens per sample when the reader lagged
                per_sample = max(len(c.token_ids) for c in out.outputs)
                self.itl.observe(max(0.0, now - st.last_token_time) / max(1, per_sample))
            st.last_token_time = now
            self.generation_tokens.inc(new_tokens)
        if not st.counted_prompt and (new_tokens or out.finished):
            st.counted_prompt = True
            self.prompt_tokens.inc(len(out.prompt_token_ids))
        for c in out.outputs:  # in delta mode a sample's finish shows up exactly once
            if c.finish_reason is not None:
                self._success.labels(self.model_name, c.finish_reason).inc()
        if out.finished:
            self._requests.pop(out.request_id, None)
            self.cached_tokens.inc(out.num_cached_tokens)
            self.e2e.observe(max(0.0, now - st.arrival))
            if out.kv_cost is not None:
                self._record_user(st.user, out.kv_cost)

    def _record_user(self, user: str, kv: dict) -> None:
        if user not in self._users:
            if len(self._users) >= MAX_USER_LABELS:
                user = "other"
            self._users.add(user)
        labels = (self.model_name, user)
        self._user_kv.labels(*labels).inc(kv["kv_block_seconds"])
        self._user_prefill.labels(*labels).inc(kv["prefill_tokens_computed"])
        self._user_cached.labels(*labels).inc(kv["prefill_tokens_cached"])
        self._user_requests.labels(*labels).inc()

    # -------------------------------------------------------------- engine snapshot
    def update_from_stats(self, stats: SchedulerStats, engine: int = 0) -> None:
        """Gauges and cumulative counters from an engine core's typed stats snapshot (``engine``: its
        data-parallel replica, the ``engine`` label when there are several)."""
        m, last, lv = self._eng[engine], self._last[engine], self._engine_labels[engine]
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting)
        m.kv_used.set(stats.kv_blocks_used)
        m.kv_total.set(stats.kv_blocks_total)
        m.kv_usage.set(stats.kv_cache_usage)
        m.offload_used.set(stats.kv_offload_blocks_used)
        m.offload_total.set(stats.kv_offload_blocks_total)
        m.offload_usage.set(stats.kv_offload_blocks_used / stats.kv_offload_blocks_total
                            if stats.kv_offload_blocks_total else 0.0)
        bb = stats.kv_offload_block_bytes
        for value, key, counter in ((stats.num_preemptions, "num_preemptions", m.preemptions),
                                    (stats.prefix_cache_queries, "prefix_cache_queries", m.prefix_queries),
                                    (stats.prefix_cache_hits, "prefix_cache_hits", m.prefix_hits),
                                    (stats.kv_offload_stored_blocks, "kv_offload_stored", m.offload_stored),
                                    (stats.kv_offload_loaded_blocks, "kv_offload_loaded", m.offload_loaded),
                                    (stats.kv_offload_stored_blocks * bb, "kv_offload_stored_b",
                                     m.offload_stored_bytes),
                                    (stats.kv_offload_loaded_blocks * bb, "kv_offload_loaded_b",
                                     m.offload_loaded_bytes),
                                    (stats.kv_offload_hit_tokens, "kv_offload_hits", m.offload_hits),
                                    (stats.kv_offload_load_seconds, "kv_offload_load_s", m.offload_load_seconds),
                                    (stats.spec_decode_num_drafts, "spec_drafts", m.spec_drafts),
                                    (stats.spec_decode_num_draft_tokens, "spec_draft_tokens", m.spec_draft_tokens),
                                    (stats.spec_decode_num_accepted_tokens, "spec_accepted",
                                     m.spec_accepted_tokens),
                                    (stats.spec_decode_propose_seconds, "spec_propose_s", m.spec_propose_seconds)):
            delta = value - last.get(key, 0)
            if delta > 0:
                counter.inc(delta)
            last[key] = max(value, last.get(key, 0))
        m.preempted.set(stats.num_preempted)
        delta_kv = stats.kv_block_seconds - last.get("kv_block_seconds", 0.0)
        if delta_kv > 0:
            m.kv_block_seconds.inc(delta_kv)
            last["kv_block_seconds"] = stats.kv_block_seconds
        for pos, value in enumerate(stats.spec_decode_num_accepted_tokens_per_pos):
            key = f"spec_pos:{pos}"
            delta = value - last.get(key, 0)
            if delta > 0:
                self._spec_per_pos.labels(*lv, str(pos)).inc(delta)
                last[key] = value
        for reason, value in stats.prefix_cache_miss_reasons.items():
            key = "miss:" + reason
            delta = value - last.get(key, 0)
            if delta > 0:
                self._miss_reason.labels(*lv, reason).inc(delta)
                last[key] = value

    def render(self) -> bytes:
        return generate_latest(self.registry)
