"""DashboardHub: what the dashboard shows, collected in the API process from the engine's typed stats.

It is an :attr:`AsyncLLM.step_listeners <tinyvllm.engine.async_llm.AsyncLLM.step_listeners>` observer,
so it sees every ``OUTPUTS`` message of the engine core -- the same
:class:`~tinyvllm.metrics.stats.SchedulerStats` / :class:`~tinyvllm.metrics.stats.IterationStats`
Prometheus reads -- and the request outputs made from it.  Per message it appends one tuple to a
bounded deque and updates a few dict entries; everything else (JSON, base64) happens only when a
dashboard is connected, at most every ``interval`` seconds per connection.

An SSE event (``data:`` JSON) carries, with times in seconds relative to the hub's start:

* ``steps``: new steps since the connection's last event, each
  ``[seq, t, prefill_tokens, decode_tokens, token_budget, step_seconds, num_reqs, generated_tokens]``;
* ``queues``: ``running``, ``waiting``, ``preempted`` (sequences);
* ``kv``: ``used`` / ``total`` blocks and, when it changed, ``map`` (base64, one byte per block:
  0 free, 1 cached-free, 2 owned; ``tinyvllm.metrics.kv_stats``);
* ``prefix_cache``: cumulative ``queries`` / ``hits`` (tokens), ``miss_reasons`` (prompts);
* ``finished``: ``[t, ttft, tpot, output_tokens]`` of requests finished since the last event;
* ``requests``: the most recent requests (running first), with cached tokens and KV cost;
* ``engine``: ``running`` (bool), ``pid``, ``model``, ``block_size``;
* ``spec_decode``: None without ``--speculative-config``; else ``method``, ``k``
  (``num_speculative_tokens``) and the cumulative counters ``drafts``, ``draft_tokens``,
  ``accepted_tokens``, ``accepted_per_pos`` / ``draft_tokens_per_pos`` (lists by position in the
  draft) and ``propose_seconds`` -- the figures of ``/metrics``' ``spec_decode_*``. The page derives
  the acceptance rate (accepted / draft tokens), the mean accepted length (1 + accepted / drafts,
  tokens per verification step), drafts/s (from the change between events) and the acceptance per
  position (accepted_per_pos / draft_tokens_per_pos).
"""

from __future__ import annotations

import base64
import time
from collections import OrderedDict, deque
from typing import Any

from tinyvllm.engine.async_llm import AsyncLLM
from tinyvllm.engine.messages import EngineCoreOutputs
from tinyvllm.outputs import RequestOutput

MAX_STEPS = 4096       # steps kept for a newly connected page
MAX_FINISHED = 2048    # latency points kept (about the last minutes under load)
MAX_ACTIVE = 256       # requests tracked while unfinished
TABLE_ROWS = 40        # requests sent per event
STALE_S = 120.0        # an unfinished request not heard of for this long is dropped (client went away)


class DashboardHub:
    """Bounded, per-step record of the engine for the dashboard; see the module docstring."""

    def __init__(self, engine: AsyncLLM) -> None:
        self.engine = engine
        self.t0 = time.monotonic()
        self.steps: deque[tuple] = deque(maxlen=MAX_STEPS)
        self.seq = 0
        self.finished: deque[tuple] = deque(maxlen=MAX_FINISHED)
        self.finished_seq = 0
        self.block_map = b""
        self.block_map_seq = 0
        self.active: OrderedDict[str, dict] = OrderedDict()
        self.done: deque[dict] = deque(maxlen=TABLE_ROWS)
        engine.step_listeners.append(self.on_step)

    # -------------------------------------------------------------- engine side (every message)
    def on_step(self, msg: EngineCoreOutputs, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        gen = 0
        for out in outs:
            gen += self._on_output(out, now)
        it = msg.iteration_stats
        if it is not None:
            self.seq += 1
            self.steps.append((self.seq, round(now - self.t0, 3), it.num_prefill_tokens, it.num_decode_tokens,
                               it.token_budget, round(it.step_seconds, 5), it.num_scheduled_reqs, gen))
            if it.kv_block_map:
                self.block_map = it.kv_block_map
                self.block_map_seq += 1

    def _on_output(self, out: RequestOutput, now: float) -> int:
        rid = out.request_id
        row = self.active.get(rid)
        new = sum(len(c.token_ids) for c in out.outputs)
        if row is None:
            m = out.metrics
            row = {"id": rid, "prompt_tokens": len(out.prompt_token_ids), "cached_tokens": out.num_cached_tokens,
                   "output_tokens": 0, "arrival": m.arrival_time if m is not None else now, "first": now,
                   "status": "running"}
            self.active[rid] = row
            if len(self.active) > MAX_ACTIVE:
                self.active.popitem(last=False)
        row["output_tokens"] += new
        row["cached_tokens"] = out.num_cached_tokens
        row["last"] = now
        if out.finished:
            self.active.pop(rid, None)
            n = row["output_tokens"]
            ttft = row["first"] - row["arrival"]
            tpot = (now - row["first"]) / (n - 1) if n > 1 else 0.0
            row.update(status="finished", ttft=round(ttft, 4), tpot=round(tpot, 5), e2e=round(now - row["arrival"], 4))
            if out.kv_cost is not None:
                row["kv_block_seconds"] = round(out.kv_cost["kv_block_seconds"], 4)
                row["peak_kv_blocks"] = out.kv_cost["peak_kv_blocks"]
            self.done.append(row)
            self.finished_seq += 1
            self.finished.append((self.finished_seq, round(now - self.t0, 3), round(ttft, 4), round(tpot, 5), n))
        return new

    # -------------------------------------------------------------- page side (per connection)
    def snapshot(self, cursor: dict[str, int]) -> dict[str, Any]:
        """The next event for a connection; ``cursor`` (updated here) remembers what it already has."""
        now = time.monotonic()
        e = self.engine
        st = e.stats
        steps = [s for s in self.steps if s[0] > cursor.get("step", 0)] if self.steps else []
        if steps:
            cursor["step"] = steps[-1][0]
        finished = [f[1:] for f in self.finished if f[0] > cursor.get("finished", 0)]
        cursor["finished"] = self.finished_seq
        for rid in [rid for rid, r in self.active.items() if now - r.get("last", now) > STALE_S]:
            self.active.pop(rid, None)
        rows = [dict(r, age=round(now - r["arrival"], 2)) for r in reversed(self.active.values())]
        rows += [dict(r) for r in reversed(self.done)]
        for r in rows:
            r.pop("arrival", None), r.pop("first", None), r.pop("last", None)
        kv: dict[str, Any] = {"used": st.kv_blocks_used, "total": st.kv_blocks_total}
        if self.block_map_seq != cursor.get("map", 0):
            cursor["map"] = self.block_map_seq
            kv["map"] = base64.b64encode(self.block_map).decode()
        info = e.engine_info
        return {
            "t": round(now - self.t0, 3),
            "engine": {"running": e.is_running, "pid": e.engine_pid, "model": e.model_name,
                       "block_size": info.block_size if info is not None else 0},
            "steps": steps,
            "queues": {"running": st.num_running, "waiting": st.num_waiting, "preempted": st.num_preempted},
            "kv": kv,
            "prefix_cache": {"queries": st.prefix_cache_queries, "hits": st.prefix_cache_hits,
                             "miss_reasons": st.prefix_cache_miss_reasons},
            "kv_block_seconds": round(st.kv_block_seconds, 3),
            "finished": finished,
            "requests": rows[:TABLE_ROWS],
            "spec_decode": self._spec_decode(st),
        }

    def _spec_decode(self, st: Any) -> dict[str, Any] | None:
        spec = self.engine.config.speculative_config
        if spec is None:
            return None
        return {"method": spec.method, "k": spec.num_speculative_tokens, "drafts": st.spec_decode_num_drafts,
                "draft_tokens": st.spec_decode_num_draft_tokens, "accepted_tokens": st.spec_decode_num_accepted_tokens,
                "accepted_per_pos": list(st.spec_decode_num_accepted_tokens_per_pos),
                "draft_tokens_per_pos": list(st.spec_decode_num_draft_tokens_per_pos),
                "propose_seconds": round(st.spec_decode_propose_seconds, 4)}
