"""``tinyvllm bench agent``: the multi-turn agent workload of ``bench serve --dataset agent``, in-process.

Same sessions as over HTTP (:func:`tinyvllm.benchmarks.datasets.agent_dataset`, same seed: one shared
system prompt + tool definitions, per turn a user message, the model's answer and a tool result), run
on the offline engine (``LLM``) with no HTTP, API process or IPC in between, so a change to the
engine is measured on the shape agents send: long prompts whose history is a prefix-cache hit, a new
tail of a few hundred tokens per turn, short answers.

``--sessions`` sessions run concurrently; the turns of one session are sequential. Turn k sends the
text ``prefix + sum_{j<k}(user_j + answer_j + tool_j) + user_k`` (the model's real answer, as over
HTTP), tokenized by the engine's tokenizer. After an answer the next turn is due ``--think-time``
seconds later (the tool running); the loop steps the engine while any request runs and sleeps only
when none does.

Per request (``time.monotonic``, seconds): TTFT = first token out of the engine's output processor -
the moment the turn was due (so a turn that becomes due during a step waits for it, as it would
over HTTP); E2E = finished - due; TPOT = (finished - first token) / (output tokens - 1). Prefill
tokens computed / cached are the engine's own counts (``RequestOutput.kv_cost``; recomputation after
a preemption is counted as computed). ``block_ideal_cached_tokens`` is what block-granular prefix
caching can serve at best: per request, the longest common token prefix with any sequence the engine
had seen when the turn was added (earlier prompts; for finished requests prompt + answer minus its
last token, whose KV is never computed), at most ``len(prompt) - 1``, rounded down to whole blocks.

    tinyvllm bench agent --sessions 4 --turns 8 --prefix-len 2200 --tool-result-len 500
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

from tinyvllm.benchmarks import datasets as ds

if TYPE_CHECKING:
    from tinyvllm.config import EngineArgs


def add_agent_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sessions", type=int, default=4, help="concurrent sessions")
    p.add_argument("--turns", type=int, default=8, help="turns per session")
    p.add_argument("--prefix-len", type=int, default=2200, help="shared system prompt + tool definitions (tokens)")
    p.add_argument("--user-len", type=int, default=30, help="user message tokens per turn")
    p.add_argument("--tool-result-len", type=int, default=500, help="tool result tokens per turn")
    p.add_argument("--output-len", type=int, default=30, help="answer tokens per turn (ignore_eos)")
    p.add_argument("--think-time", type=float, default=0.5, help="seconds between an answer and the next turn")
    p.add_argument("--dataset-seed", type=int, default=0, help="seed of the workload (bench serve's --seed)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let answers stop at EOS (default: exactly --output-len tokens, as bench serve)")
    p.add_argument("--result-file", default=None, help="write the result as JSON here")


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """Number of leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def block_ideal_cached(prompt: Sequence[int], seen: Sequence[Sequence[int]], block_size: int) -> int:
    """Tokens of ``prompt`` a block-granular prefix cache can serve at best, given the sequences
    ``seen`` whose KV exists: the longest common prefix with any of them, capped at ``len(prompt) - 1``
    (the last prompt token is always computed), rounded down to a multiple of ``block_size``."""
    lcp = max((common_prefix_len(prompt, s) for s in seen), default=0)
    return (min(lcp, len(prompt) - 1) // block_size) * block_size


@dataclasses.dataclass
class _Turn:
    session: int
    turn: int
    due: float  # time.monotonic when the turn was due
    prompt_ids: list[int]
    ideal_cached: int


def run_agent(llm: Any, workload: ds.AgentWorkload, *, ignore_eos: bool = True,
              temperature: float = 0.0) -> dict[str, Any]:
    """Run every session of ``workload`` to the end on ``llm`` (an offline ``LLM``).

    Returns:
        dict: ``wall_s`` (first turn due -> last answer), ``num_requests``, ``output_tokens``,
        ``prompt_tokens``, ``prefill_tokens_computed`` / ``prefill_tokens_cached`` (engine counts, summed),
        ``prefix_cache_hit_pct`` (cached / prompt tokens, %), ``block_ideal_cached_tokens`` and
        ``block_ideal_hit_pct``, ``median_ttft_ms`` / ``p90_ttft_ms``, ``median_tpot_ms`` /
        ``mean_tpot_ms`` (decode, ms per output token after the first), ``per_turn`` (per turn index:
        ``median_ttft_ms``, ``p90_ttft_ms``, mean prompt / computed / cached tokens) and ``requests``
        (one dict per request: session, turn, start_s, ttft_s, e2e_s, tpot_s, prompt_tokens,
        prefill_tokens_computed, prefill_tokens_cached, block_ideal_cached, output_tokens,
        generated_text, output_token_ids).
    """
    from tinyvllm.sampling_params import SamplingParams

    eng = llm.llm_engine
    block_size = eng.config.cache_config.block_size
    sessions = workload.sessions
    histories = [s.prefix for s in sessions]
    seen: list[list[int]] = []  # token sequences whose KV the engine has computed (or is computing)
    running: dict[str, _Turn] = {}
    due: list[tuple[float, int, int]] = []  # (due time, session, turn)
    records: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for i in range(len(sessions)):
        due.append((t0, i, 0))

    def add(session: int, turn: int, when: float) -> None:
        sess = sessions[session]
        text = histories[session] + sess.user_block(turn)
        histories[session] = text
        _, ids = eng.tokenize_prompt(text)
        params = SamplingParams(temperature=temperature, max_tokens=sess.max_tokens, ignore_eos=ignore_eos)
        rid = eng.add_request({"prompt_token_ids": ids, "prompt": text}, params)
        running[rid] = _Turn(session, turn, when, ids, block_ideal_cached(ids, seen, block_size))
        seen.append(ids)

    while due or running:
        now = time.monotonic()
        ready = sorted(d for d in due if d[0] <= now)
        for d in ready:
            due.remove(d)
            add(d[1], d[2], d[0])
        if not running:
            time.sleep(max(0.0, min(d[0] for d in due) - time.monotonic()))
            continue
        for out in eng.step():
            if not out.finished:
                continue
            t = running.pop(out.request_id)
            m = out.metrics
            comp = out.outputs[0]
            n_out = len(comp.token_ids)
            kv = out.kv_cost or {}
            records.append({
                "session": t.session, "turn": t.turn, "start_s": t.due - t0,
                "ttft_s": m.first_token_time - t.due if m.first_token_time is not None else None,
                "e2e_s": m.finished_time - t.due,
                "tpot_s": (m.finished_time - m.first_token_time) / (n_out - 1) if n_out > 1 else None,
                "prompt_tokens": len(t.prompt_ids), "output_tokens": n_out,
                "prefill_tokens_computed": kv.get("prefill_tokens_computed", len(t.prompt_ids) - out.num_cached_tokens),
                "prefill_tokens_cached": kv.get("prefill_tokens_cached", out.num_cached_tokens),
                "num_cached_tokens": out.num_cached_tokens, "block_ideal_cached": t.ideal_cached,
                "generated_text": comp.text, "output_token_ids": list(comp.token_ids),
            })
            seen.append(list(t.prompt_ids) + list(comp.token_ids[:-1]))
            sess = sessions[t.session]
            histories[t.session] += comp.text
            if t.turn + 1 < sess.num_turns:
                histories[t.session] += sess.tool_block(t.turn)
                due.append((m.finished_time + workload.think_time, t.session, t.turn + 1))
    wall = max((r["start_s"] + r["e2e_s"] for r in records), default=0.0)
    return summarize(records, wall, block_size, workload.meta)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    v = sorted(values)
    k = (len(v) - 1) * q  # linear interpolation, as numpy.percentile's default
    lo = int(k)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (k - lo)


def summarize(records: list[dict[str, Any]], wall_s: float, block_size: int, meta: dict | None = None
              ) -> dict[str, Any]:
    """Aggregate :func:`run_agent`'s per-request records (see there for the keys)."""
    records = sorted(records, key=lambda r: (r["session"], r["turn"]))
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["prefill_tokens_cached"] for r in records)
    ideal = sum(r["block_ideal_cached"] for r in records)
    ttfts = [r["ttft_s"] * 1e3 for r in records if r["ttft_s"] is not None]
    tpots = [r["tpot_s"] * 1e3 for r in records if r["tpot_s"] is not None]
    per_turn = []
    for t in sorted({r["turn"] for r in records}):
        rs = [r for r in records if r["turn"] == t]
        tt = [r["ttft_s"] * 1e3 for r in rs if r["ttft_s"] is not None]
        per_turn.append({
            "turn": t, "num_requests": len(rs), "median_ttft_ms": _pct(tt, 0.5), "p90_ttft_ms": _pct(tt, 0.9),
            "mean_prompt_tokens": statistics.mean(r["prompt_tokens"] for r in rs),
            "mean_computed_tokens": statistics.mean(r["prefill_tokens_computed"] for r in rs),
            "mean_cached_tokens": statistics.mean(r["prefill_tokens_cached"] for r in rs),
        })
    return {
        "workload": "agent", "dataset_args": dict(meta or {}), "block_size": block_size,
        "wall_s": wall_s, "num_requests": len(records),
        "output_tokens": sum(r["output_tokens"] for r in records), "prompt_tokens": prompt,
        "prefill_tokens_computed": sum(r["prefill_tokens_computed"] for r in records),
        "prefill_tokens_cached": cached,
        "prefix_cache_hit_pct": 100.0 * cached / prompt if prompt else 0.0,
        "block_ideal_cached_tokens": ideal, "block_ideal_hit_pct": 100.0 * ideal / prompt if prompt else 0.0,
        "median_ttft_ms": _pct(ttfts, 0.5), "p90_ttft_ms": _pct(ttfts, 0.9),
        "median_tpot_ms": _pct(tpots, 0.5), "mean_tpot_ms": statistics.mean(tpots) if tpots else None,
        "per_turn": per_turn, "requests": records,
    }


def format_agent_table(res: dict[str, Any]) -> str:
    """The result as a text table: the totals, then one line per turn index."""
    def f(v: Any, spec: str) -> str:
        return "n/a" if v is None else format(v, spec)

    a = res["dataset_args"]
    lines = [
        f"agent workload in-process: {a.get('sessions')} sessions x {a.get('turns')} turns, prefix "
        f"{a.get('prefix_len')}, tool result {a.get('tool_result_len')}, answer {a.get('output_len')} tokens, "
        f"think {a.get('think_time')} s, block size {res['block_size']}",
        f"wall time {res['wall_s']:.2f} s   requests {res['num_requests']}   output tokens {res['output_tokens']}",
        f"prefill tokens: prompt {res['prompt_tokens']}, computed {res['prefill_tokens_computed']}, cached "
        f"{res['prefill_tokens_cached']} ({res['prefix_cache_hit_pct']:.1f} %; block-ideal "
        f"{res['block_ideal_cached_tokens']}, {res['block_ideal_hit_pct']:.1f} %)",
        f"TTFT median {f(res['median_ttft_ms'], '.1f')} ms, p90 {f(res['p90_ttft_ms'], '.1f')} ms   "
        f"decode TPOT median {f(res['median_tpot_ms'], '.2f')} ms",
        f"{'turn':>4} {'n':>3} {'TTFT med ms':>11} {'TTFT p90 ms':>11} {'prompt':>7} {'computed':>8} {'cached':>7}",
    ]
    for t in res["per_turn"]:
        lines.append(f"{t['turn']:>4} {t['num_requests']:>3} {f(t['median_ttft_ms'], '.1f'):>11} "
                     f"{f(t['p90_ttft_ms'], '.1f'):>11} {t['mean_prompt_tokens']:>7.0f} "
                     f"{t['mean_computed_tokens']:>8.0f} {t['mean_cached_tokens']:>7.0f}")
    return "\n".join(lines)


def main_agent(args: argparse.Namespace, engine_args: EngineArgs, make_llm: Callable[..., Any]) -> dict[str, Any]:
    """``bench agent``: build the ``LLM`` (``make_llm(**engine options)``), warm it up on one short
    request, reset the prefix cache, run the workload, print :func:`format_agent_table`."""
    from tinyvllm.sampling_params import SamplingParams

    llm = make_llm(**dataclasses.asdict(engine_args))
    llm.generate(["warm up"], SamplingParams(max_tokens=4, temperature=0.0))
    llm.llm_engine.core.reset_prefix_cache()
    wl = ds.agent_dataset(sessions=args.sessions, turns=args.turns, prefix_len=args.prefix_len,
                          user_len=args.user_len, output_len=args.output_len,
                          tool_result_len=args.tool_result_len, think_time=args.think_time,
                          seed=args.dataset_seed)
    res = run_agent(llm, wl, ignore_eos=args.ignore_eos)
    res["model"] = engine_args.model
    print(format_agent_table(res))
    if args.result_file:
        Path(args.result_file).parent.mkdir(parents=True, exist_ok=True)
        Path(args.result_file).write_text(json.dumps(res, indent=2, default=str))
    return res
