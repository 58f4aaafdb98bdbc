"""Per-request records and the aggregate metrics of one benchmark run.

Definitions (all latencies measured on the client, ``time.perf_counter``):

* TTFT: request sent -> first streamed chunk that carries non-empty text.
* ITL: the gaps between successive content-carrying chunks. A chunk that
  carries several tokens (servers may coalesce) counts as ONE arrival, so a
  request yields ``num_content_chunks - 1`` ITL samples, which may be fewer
  than ``output_tokens - 1``.
* E2E: request sent -> end of the stream (``[DONE]`` or connection close).
* TPOT: ``(e2e - ttft) / (output_tokens - 1)`` with ``output_tokens`` from the
  server's final ``usage`` (falls back to the number of content chunks when
  the server sends no usage). Undefined for single-token outputs.
* prompt/output/cached tokens: the final ``usage`` chunk;
  cached = ``usage.prompt_tokens_details.cached_tokens`` when present.

Throughputs divide by the run's duration: benchmark start -> last request end.
Latency statistics use successful requests only; failed ones are counted in
``errors``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

import numpy as np

PERCENTILES = (50, 90, 99)


@dataclass
class RequestRecord:
    request_id: int
    start_time: float = 0.0  # seconds since benchmark start
    success: bool = False
    error: str = ""
    status_code: int | None = None
    ttft: float | None = None  # seconds
    itl: list[float] = field(default_factory=list)  # seconds
    e2e: float | None = None  # seconds
    tpot: float | None = None  # seconds
    prompt_tokens: int | None = None
    output_tokens: int = 0
    cached_tokens: int | None = None
    num_chunks: int = 0  # content-carrying chunks
    prompt_len: int | None = None  # nominal length from the dataset
    max_tokens: int | None = None
    session_id: int | None = None
    turn: int | None = None
    group_id: int | None = None
    generated_text: str = ""
    tool_call_valid: bool | None = None  # agent --agent-tool-calls: the answer is a valid tool call

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _stats(name: str, values_s: Iterable[float], out: dict[str, Any]) -> None:
    """mean/median/std/min/max/pXX of ``values_s`` (seconds) written in ms."""
    arr = np.asarray([v for v in values_s if v is not None], dtype=float) * 1000.0
    keys = ["mean", "median", "std", "min", "max"] + [f"p{p}" for p in PERCENTILES]
    if arr.size == 0:
        for k in keys:
            out[f"{k}_{name}_ms"] = None
        return
    out[f"mean_{name}_ms"] = float(arr.mean())
    out[f"median_{name}_ms"] = float(np.median(arr))
    out[f"std_{name}_ms"] = float(arr.std())
    out[f"min_{name}_ms"] = float(arr.min())
    out[f"max_{name}_ms"] = float(arr.max())
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))


def peak_concurrency(records: Iterable[RequestRecord]) -> int:
    """Largest number of requests in flight at once (client's view)."""
    events = []
    for r in records:
        if r.e2e is None:
            continue
        events.append((r.start_time, 1))
        events.append((r.start_time + r.e2e, -1))
    events.sort(key=lambda e: (e[0], e[1]))  # ends before starts at equal times
    cur = peak = 0
    for _, d in events:
        cur += d
        peak = max(peak, cur)
    return peak


def compute_metrics(records: list[RequestRecord], duration: float) -> dict[str, Any]:
    ok = [r for r in records if r.success]
    duration = max(duration, 1e-9)
    total_in = sum(r.prompt_tokens or 0 for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    cached_known = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    total_cached = int(sum(cached_known))
    m: dict[str, Any] = {
        "duration": duration,
        "num_requests": len(records),
        "completed": len(ok),
        "errors": len(records) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "total_cached_tokens": total_cached if cached_known else None,
        "prefix_cache_hit_rate": (total_cached / total_in) if (cached_known and total_in) else None,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "peak_concurrency": peak_concurrency(records),
    }
    _stats("ttft", (r.ttft for r in ok), m)
    _stats("tpot", (r.tpot for r in ok), m)
    _stats("itl", (x for r in ok for x in r.itl), m)
    _stats("e2el", (r.e2e for r in ok), m)
    return m


def per_turn_stats(records: list[RequestRecord]) -> list[dict[str, Any]]:
    """Agent workload: aggregates per turn index over all sessions."""
    turns: dict[int, list[RequestRecord]] = {}
    by_session: dict[tuple[int | None, int], RequestRecord] = {}
    for r in records:
        if r.turn is not None:
            turns.setdefault(r.turn, []).append(r)
            by_session[(r.session_id, r.turn)] = r
    out = []
    for t in sorted(turns):
        rs = turns[t]
        ok = [r for r in rs if r.success]
        ttfts = np.asarray([r.ttft for r in ok if r.ttft is not None], dtype=float) * 1000.0
        prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
        cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
        # Prefill tokens the server computed (prompt - cached), and the share of the session's history
        # (the previous turn's prompt + answer) that came from a cache (pool or offload tier).
        computed = [r.prompt_tokens - r.cached_tokens for r in ok
                    if r.prompt_tokens is not None and r.cached_tokens is not None]
        hist_frac = []
        for r in ok:
            prev = by_session.get((r.session_id, t - 1))
            if t > 0 and prev is not None and prev.success and prev.prompt_tokens and r.cached_tokens is not None:
                hist_frac.append(min(1.0, r.cached_tokens / (prev.prompt_tokens + prev.output_tokens)))
        out.append(
            {
                "turn": t,
                "num_requests": len(rs),
                "completed": len(ok),
                "mean_ttft_ms": float(ttfts.mean()) if ttfts.size else None,
                "median_ttft_ms": float(np.median(ttfts)) if ttfts.size else None,
                "p90_ttft_ms": float(np.percentile(ttfts, 90)) if ttfts.size else None,
                "mean_prompt_tokens": float(np.mean(prompts)) if prompts else None,
                "mean_cached_tokens": float(np.mean(cached)) if cached else None,
                "mean_computed_tokens": float(np.mean(computed)) if computed else None,
                "total_computed_tokens": int(np.sum(computed)) if computed else None,
                "mean_history_cached_frac": float(np.mean(hist_frac)) if hist_frac else None,
                "mean_e2el_ms": float(np.mean([r.e2e for r in ok]) * 1000.0) if ok else None,
            }
        )
    return out
