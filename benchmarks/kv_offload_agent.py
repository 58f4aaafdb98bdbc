"""The KV offload benchmark of issue 14: agent sessions whose contexts do not fit the device pool.

For each configuration (tier off / host tier / disk tier) a fresh ``tinyvllm serve`` is started with
a pool of ``--num-kv-blocks`` (about two sessions' final contexts), ``tinyvllm bench serve --dataset
agent`` runs ``--sessions`` concurrent sessions of ``--turns`` turns with ``--think-time`` between
turns, and the server is stopped. Prints per turn: prefill tokens computed, the share of the history
served from a cache, mean TTFT; and the wall time. Writes the JSON results and a PNG comparison.

    .venv/bin/python benchmarks/kv_offload_agent.py --out bench_results/kv_offload
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tinyvllm.benchmarks import report  # noqa: E402


def _serve(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("server did not start")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="bench_results/kv_offload")
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--think-time", type=float, default=1.0)
    ap.add_argument("--prefix-len", type=int, default=500)
    ap.add_argument("--user-len", type=int, default=30)
    ap.add_argument("--tool-result-len", type=int, default=100)
    ap.add_argument("--output-len", type=int, default=30)
    ap.add_argument("--num-kv-blocks", type=int, default=224, help="~2 sessions' final contexts")
    ap.add_argument("--kv-offload-size", default="512MiB")
    ap.add_argument("--configs", default="off,host,disk")
    ap.add_argument("--plot", default=None, help="PNG path of the comparison plot")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    disk_dir = Path(tempfile.mkdtemp(prefix="kv14-tier-"))
    base = ["--dtype", "bfloat16", "--num-kv-blocks", str(args.num_kv_blocks)]
    configs = {"off": [], "host": ["--kv-offload-size", args.kv_offload_size],
               "disk": ["--kv-offload-size", args.kv_offload_size, "--kv-offload-path", str(disk_dir)]}
    results, labels = [], []
    try:
        for name in args.configs.split(","):
            proc = _serve(args.port, base + configs[name], out / f"server_{name}.log")
            try:
                t0 = time.monotonic()
                subprocess.run([sys.executable, "-m", "tinyvllm.entrypoints.cli", "bench", "serve",
                                "--base-url", f"http://127.0.0.1:{args.port}", "--dataset", "agent",
                                "--sessions", str(args.sessions), "--turns", str(args.turns),
                                "--think-time", str(args.think_time), "--prefix-len", str(args.prefix_len),
                                "--user-len", str(args.user_len), "--tool-result-len", str(args.tool_result_len),
                                "--output-len", str(args.output_len), "--result-dir", str(out), "--label", name,
                                "--result-file", f"agent_{name}.json", "--no-plot"], check=True)
                wall = time.monotonic() - t0
                metrics = httpx.get(f"http://127.0.0.1:{args.port}/metrics", timeout=10).text
            finally:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
            res = json.loads((out / f"agent_{name}.json").read_text())
            res["wall_s"] = wall
            res["kv_offload_metrics"] = [ln for ln in metrics.splitlines()
                                         if ln.startswith("tinyvllm:kv_offload") or
                                         ln.startswith("tinyvllm:prefix_cache_hits")]
            (out / f"agent_{name}.json").write_text(json.dumps(res, indent=1))
            results.append(res)
            labels.append(name)
    finally:
        shutil.rmtree(disk_dir, ignore_errors=True)
    print(f"\n{'config':>6} {'turn':>4} {'computed tok/req':>16} {'hist from cache':>15} {'mean TTFT ms':>12}")
    for name, res in zip(labels, results):
        for t in res["per_turn"]:
            frac = t.get("mean_history_cached_frac")
            print(f"{name:>6} {t['turn']:>4} {t['mean_computed_tokens']:>16.0f} "
                  f"{'' if frac is None else f'{100 * frac:.1f}%':>15} {t['mean_ttft_ms']:>12.0f}")
        print(f"{name:>6} wall {res['wall_s']:.1f} s")
    plot = args.plot or str(out / "kv_offload_agent_ttft.png")
    report.plot_agent_comparison(results, labels, plot)
    print("plot:", plot)


if __name__ == "__main__":
    main()
