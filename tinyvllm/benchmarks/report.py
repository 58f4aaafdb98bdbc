"""Reports of benchmark results: a text table, JSON files and PNG plots.

Plots use matplotlib's Agg canvas directly (no pyplot, no global backend
switch, no display needed).

``python -m tinyvllm.benchmarks.report concurrency a.json b.json -o out.png``
draws throughput/latency vs concurrency from several result files.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any, Iterable, Sequence

import numpy as np

_W = 50


def _fmt(v: Any, prec: int = 2) -> str:
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.{prec}f}"
    return str(v)


def format_table(result: dict[str, Any]) -> str:
    r = result
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=_W, c="=")]

    def row(name: str, v: Any, prec: int = 2) -> None:
        lines.append(f"{name:<36}{_fmt(v, prec):>{_W - 36}}")

    def section(title: str) -> None:
        lines.append("{s:{c}^{n}}".format(s=f" {title} ", n=_W, c="-"))

    if r.get("dataset"):
        row("Dataset:", r["dataset"])
    row("Max concurrency:", r.get("max_concurrency") or "inf")
    row("Request rate (req/s):", r.get("request_rate"))
    row("Successful requests:", r.get("completed"))
    row("Failed requests:", r.get("errors"))
    row("Benchmark duration (s):", r.get("duration"))
    row("Total input tokens:", r.get("total_input_tokens"))
    row("Total generated tokens:", r.get("total_output_tokens"))
    if r.get("total_cached_tokens") is not None:
        row("Total cached prompt tokens:", r.get("total_cached_tokens"))
        row("Prefix cache hit rate:", r.get("prefix_cache_hit_rate"), 3)
    row("Request throughput (req/s):", r.get("request_throughput"))
    row("Output token throughput (tok/s):", r.get("output_throughput"))
    row("Total token throughput (tok/s):", r.get("total_token_throughput"))
    row("Peak concurrent requests:", r.get("peak_concurrency"))
    for key, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st)"),
        ("itl", "Inter-token Latency"),
        ("e2el", "End-to-end Latency"),
    ):
        section(title)
        for stat, label in (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99")):
            row(f"{label} {key.upper()} (ms):", r.get(f"{stat}_{key}_ms"))
    if r.get("per_turn"):
        section("Agent turns")
        lines.append(f"{'turn':>4} {'n':>3} {'mean TTFT ms':>12} {'prompt tok':>10} {'cached tok':>10} "
                     f"{'computed':>8} {'hist%':>5}")
        for t in r["per_turn"]:
            frac = t.get("mean_history_cached_frac")
            lines.append(
                f"{t['turn']:>4} {t['completed']:>3} {_fmt(t['mean_ttft_ms'], 1):>12} "
                f"{_fmt(t['mean_prompt_tokens'], 0):>10} {_fmt(t['mean_cached_tokens'], 0):>10} "
                f"{_fmt(t.get('mean_computed_tokens'), 0):>8} {_fmt(None if frac is None else 100 * frac, 0):>5}"
            )
    if r.get("tool_calls"):
        tc = r["tool_calls"]
        row("Valid constrained tool calls:", f"{tc['valid']} / {tc['answered']}")
    lines.append("=" * _W)
    return "\n".join(lines)


def _json_safe(o: Any) -> Any:
    if isinstance(o, float) and not math.isfinite(o):
        return "inf" if o > 0 else ("-inf" if o < 0 else None)
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    return o


def save_json(result: dict[str, Any], path: str) -> str:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump(_json_safe(result), f, indent=1, allow_nan=False)
    return path


def load_result(path: str) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


# ---------------------------------------------------------------- plots


def _figure(rows: int, cols: int, size: tuple[float, float]):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    return fig, axes


def _save(fig, path: str) -> str:
    d = os.path.dirname(path)
    if d:
        os.makedirs(d, exist_ok=True)
    fig.savefig(path, dpi=100)
    return path


def plot_latency(result: dict[str, Any], path: str) -> str:
    """Histograms (top) and CDFs (bottom) of TTFT, TPOT, ITL and E2E (ms)."""
    ok = [r for r in result.get("requests", []) if r.get("success")]
    series = {
        "TTFT": [r["ttft"] for r in ok if r.get("ttft") is not None],
        "TPOT": [r["tpot"] for r in ok if r.get("tpot") is not None],
        "ITL": [x for r in ok for x in (r.get("itl") or [])],
        "E2E": [r["e2e"] for r in ok if r.get("e2e") is not None],
    }
    fig, axes = _figure(2, 4, (16, 7))
    for j, (name, vals) in enumerate(series.items()):
        ms = np.sort(np.asarray(vals, dtype=float) * 1000.0)
        h, c = axes[0][j], axes[1][j]
        h.set_title(f"{name} (n={ms.size})")
        c.set_xlabel(f"{name} (ms)")
        if ms.size:
            h.hist(ms, bins=min(50, max(5, ms.size // 4)), color="C%d" % j)
            for p, style in ((50, "--"), (99, ":")):
                h.axvline(np.percentile(ms, p), color="k", ls=style, lw=1, label=f"p{p}")
            h.legend(fontsize=8)
            c.plot(ms, np.arange(1, ms.size + 1) / ms.size, color="C%d" % j)
        h.set_ylabel("count")
        c.set_ylabel("CDF")
        c.grid(alpha=0.3)
    title = f"{result.get('dataset', '')} {result.get('model', '')} conc={result.get('max_concurrency') or 'inf'}"
    fig.suptitle(title.strip())
    return _save(fig, path)


def plot_agent_turns(result: dict[str, Any], path: str) -> str:
    """Per-turn TTFT (mean, p90, every request) and prompt vs cached tokens."""
    turns = result.get("per_turn") or []
    reqs = [r for r in result.get("requests", []) if r.get("success") and r.get("turn") is not None]
    fig, axes = _figure(1, 2, (13, 4.5))
    a, b = axes[0]
    x = [t["turn"] for t in turns]
    a.scatter(
        [r["turn"] for r in reqs if r.get("ttft") is not None],
        [r["ttft"] * 1000 for r in reqs if r.get("ttft") is not None],
        s=10, alpha=0.4, color="gray", label="requests",
    )
    a.plot(x, [t["mean_ttft_ms"] for t in turns], "o-", label="mean")
    a.plot(x, [t["p90_ttft_ms"] for t in turns], "s--", label="p90")
    a.set_xticks(x)
    a.set_xlabel("turn")
    a.set_ylabel("TTFT (ms)")
    a.set_title("TTFT per turn")
    a.grid(alpha=0.3)
    a.legend()
    prompt = [t["mean_prompt_tokens"] or 0 for t in turns]
    cached = [t["mean_cached_tokens"] or 0 for t in turns]
    xs = np.arange(len(turns))
    b.bar(xs - 0.2, prompt, 0.4, label="prompt tokens")
    b.bar(xs + 0.2, cached, 0.4, label="cached tokens")
    b.set_xticks(xs, [str(t) for t in x])
    b.set_xlabel("turn")
    b.set_ylabel("tokens (mean over sessions)")
    b.set_title("prompt vs cached tokens per turn")
    b.legend()
    b.grid(alpha=0.3, axis="y")
    return _save(fig, path)


def plot_agent_comparison(results: list[dict[str, Any]], labels: list[str], path: str) -> str:
    """Agent workload under several configurations (e.g. prefix caching on/off): mean TTFT per
    turn, and per turn the prefill tokens computed (prompt - cached) vs served from the cache."""
    fig, axes = _figure(1, 2, (13, 4.5))
    a, b = axes[0]
    width = 0.8 / max(1, len(results))
    for i, (res, label) in enumerate(zip(results, labels)):
        turns = res.get("per_turn") or []
        x = [t["turn"] for t in turns]
        a.plot(x, [t["mean_ttft_ms"] / 1000 for t in turns], "o-", label=label)
        prompt = np.array([t["mean_prompt_tokens"] or 0 for t in turns], dtype=float)
        cached = np.array([t["mean_cached_tokens"] or 0 for t in turns], dtype=float)
        xs = np.arange(len(turns)) + (i - (len(results) - 1) / 2) * width
        b.bar(xs, prompt - cached, width, label=f"{label}: computed")
        b.bar(xs, cached, width, bottom=prompt - cached, alpha=0.35, label=f"{label}: from cache")
    a.set_xlabel("turn")
    a.set_ylabel("mean TTFT (s)")
    a.set_title("TTFT per turn")
    a.grid(alpha=0.3)
    a.legend()
    b.set_xlabel("turn")
    b.set_ylabel("prompt tokens per request (mean)")
    b.set_title("prefill tokens computed vs served from cache")
    b.grid(alpha=0.3, axis="y")
    b.legend(fontsize=8)
    return _save(fig, path)


def save_plots(result: dict[str, Any], stem: str) -> list[str]:
    """Write ``<stem>_latency.png`` (+ ``<stem>_agent_turns.png``)."""
    paths = [plot_latency(result, stem + "_latency.png")]
    if result.get("per_turn"):
        paths.append(plot_agent_turns(result, stem + "_agent_turns.png"))
    return paths


def _concurrency_of(r: dict[str, Any]) -> float:
    c = r.get("max_concurrency")
    if c:
        return float(c)
    return float(r.get("peak_concurrency") or r.get("num_requests") or 0)


def plot_throughput_vs_concurrency(
    results: Sequence[dict[str, Any] | str], path: str, *, group_by: str = "label"
) -> str:
    """Output tok/s, req/s and median TTFT/TPOT vs max concurrency.

    ``results`` are result dicts or JSON paths; one line per distinct
    ``group_by`` value (falls back to ``dataset``/``model``). Runs without
    ``max_concurrency`` are placed at their observed peak concurrency.
    """
    rs = [load_result(r) if isinstance(r, (str, os.PathLike)) else r for r in results]
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in rs:
        key = r.get(group_by) or r.get("label") or f"{r.get('dataset', '')} {r.get('model', '')}".strip()
        groups.setdefault(str(key), []).append(r)
    fig, axes = _figure(1, 3, (17, 4.5))
    a, b, c = axes[0]
    for name, g in groups.items():
        g = sorted(g, key=_concurrency_of)
        xs = [_concurrency_of(r) for r in g]
        a.plot(xs, [r.get("output_throughput") for r in g], "o-", label=name)
        b.plot(xs, [r.get("request_throughput") for r in g], "o-", label=name)
        c.plot(xs, [r.get("median_ttft_ms") for r in g], "o-", label=f"{name} TTFT")
        c.plot(xs, [r.get("median_tpot_ms") for r in g], "s--", label=f"{name} TPOT")
    for ax, ylab in ((a, "output tokens/s"), (b, "requests/s"), (c, "median latency (ms)")):
        ax.set_xlabel("max concurrency")
        ax.set_ylabel(ylab)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if len({_concurrency_of(r) for r in rs}) > 2 and min(_concurrency_of(r) for r in rs) > 0:
        ticks = sorted({_concurrency_of(r) for r in rs})
        for ax in (a, b, c):
            ax.set_xscale("log", base=2)
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.minorticks_off()
    a.set_title("output throughput vs concurrency")
    b.set_title("request throughput vs concurrency")
    c.set_title("latency vs concurrency")
    return _save(fig, path)


def main(argv: Iterable[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Plots from benchmark result JSONs.")
    sub = p.add_subparsers(dest="cmd", required=True)
    pc = sub.add_parser("concurrency", help="throughput/latency vs concurrency")
    pc.add_argument("results", nargs="+")
    pc.add_argument("-o", "--output", default="throughput_vs_concurrency.png")
    pl = sub.add_parser("plots", help="latency (+ agent) plots of one result")
    pl.add_argument("result")
    args = p.parse_args(list(argv) if argv is not None else None)
    if args.cmd == "concurrency":
        print(plot_throughput_vs_concurrency(args.results, args.output))
    else:
        for path in save_plots(load_result(args.result), os.path.splitext(args.result)[0]):
            print(path)


if __name__ == "__main__":
    main()
