#!/usr/bin/env python3
"""Start several OpenAI-compatible servers one after another on this machine, measure each the same
way, and print one table with tinyvllm's figure, each peer's, and their ratio.

    .venv/bin/python benchmarks/side_by_side.py \
        --server tinyvllm http://127.0.0.1:8000 ".venv/bin/tinyvllm serve --port 8000" \
        --server vllm http://127.0.0.1:8001 "/path/to/start-vllm.sh" \
        --server llamacpp http://127.0.0.1:8002 "/path/to/start-llama.sh" \
        --out bench_results/side-by-side

Per server, alone on the machine (the previous one is stopped first):
  * start time: from launching the command until ``GET /health`` answers 200;
  * peak RSS of the server's whole process group (sampled every 0.25 s), and RSS when idle after start;
  * one stream (256-token prompt, 128 output tokens, 8 requests): median TTFT and TPOT;
  * concurrency 16 (64 requests, 256 / 128): output tokens/s and median TTFT;
  * a shared 1,024-token prefix + 64 new prompt tokens (8 requests, one stream): median TTFT of the
    cache hits (the first request fills the cache).
The first ``--server`` is the reference for the ratio columns. Workloads are
``python -m tinyvllm.benchmarks.serve`` with fixed seeds and token-id prompts, so every server gets
the same requests. Peers are not dependencies of tinyvllm; start them with their own commands.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = os.environ.get("PY", str(ROOT / ".venv" / "bin" / "python"))


def group_processes(pgid: int) -> dict[int, dict]:
    """Every process in process group ``pgid``, from /proc: {pid: {name, rss_bytes, cpu_s}} (cpu_s: user +
    system seconds so far; name: the command line, cut to 60 characters)."""
    tick, procs = os.sysconf("SC_CLK_TCK"), {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
            fields = stat[stat.rindex(")") + 2:].split()
            if int(fields[2]) != pgid:  # field 5 of stat: process group
                continue
            rss = 0
            for line in (d / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss = int(line.split()[1]) * 1024
            name = (d / "cmdline").read_text().replace("\0", " ").strip()[:60] or stat[stat.index("(") + 1:stat.rindex(")")]
            procs[int(d.name)] = {"name": name, "rss_bytes": rss, "cpu_s": (int(fields[11]) + int(fields[12])) / tick}
        except (OSError, ValueError):
            continue
    return procs


def group_rss_bytes(pgid: int) -> int:
    """Resident memory of every process in process group ``pgid`` (bytes, from /proc)."""
    return sum(p["rss_bytes"] for p in group_processes(pgid).values())


class RssSampler(threading.Thread):
    def __init__(self, pgid: int, period: float = 0.25) -> None:
        super().__init__(daemon=True)
        self.pgid, self.period, self.peak, self.stop = pgid, period, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, group_rss_bytes(self.pgid))
            time.sleep(self.period)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float) -> float:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before /health answered")
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return time.perf_counter() - t0
        except Exception:
            pass
        time.sleep(0.05)
    raise TimeoutError(f"{url}/health did not answer within {timeout} s")


def run_workload(name: str, url: str, model: str, out: Path, tag: str, extra: list[str]) -> dict:
    f = out / f"{name}-{tag}.json"
    cmd = [PY, "-m", "tinyvllm.benchmarks.serve", "--base-url", url, "--model", model, "--prompt-format",
           "token-ids", "--label", name, "--result-file", str(f), "--no-plot", "--disable-tqdm", *extra]
    subprocess.run(cmd, check=True, cwd=ROOT)
    r = json.loads(f.read_text())
    return r.get("metrics", r)


def start_server(name: str, command: str, out: Path) -> subprocess.Popen:
    """Launch ``command`` (a shell line) in its own process group, output to ``out/<name>-server.log``."""
    print(f"== {name}: starting: {command}", flush=True)
    return subprocess.Popen(command, shell=True, start_new_session=True, cwd=ROOT,
                            stdout=open(out / f"{name}-server.log", "w"), stderr=subprocess.STDOUT)


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL it after 30 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def measure(name: str, url: str, command: str, model: str, out: Path, start_timeout: float,
            c1_prompts: int = 8, c16_prompts: int = 64, prefix: bool = True, input_len: int = 256,
            output_len: int = 128) -> dict:
    t_launch = time.perf_counter()
    proc = start_server(name, command, out)
    sampler = RssSampler(proc.pid)
    sampler.start()
    res: dict = {"server": name, "command": command}
    try:
        res["start_s"] = wait_healthy(url, proc, start_timeout)
        time.sleep(1.0)
        res["idle_rss_gb"] = group_rss_bytes(proc.pid) / 1e9
        common = ["--dataset", "random", "--input-len", str(input_len), "--output-len", str(output_len)]
        run_workload(name, url, model, out, "warmup", common + ["--num-prompts", "2", "--max-concurrency", "1",
                                                                  "--seed", "99"])
        m1 = run_workload(name, url, model, out, "c1", common + ["--num-prompts", str(c1_prompts),
                                                                 "--max-concurrency", "1"])
        m16 = run_workload(name, url, model, out, "c16", common + ["--num-prompts", str(c16_prompts),
                                                                   "--max-concurrency", "16", "--seed", "1"])
        mp = run_workload(name, url, model, out, "prefix",
                          ["--dataset", "shared-prefix", "--prefix-len", "1024", "--suffix-len", "64",
                           "--output-len", "64", "--num-groups", "1", "--num-prompts", "8", "--max-concurrency", "1",
                           "--seed", "2"]) if prefix else {}
        res.update(
            c1_ttft_ms=m1["median_ttft_ms"], c1_tpot_ms=m1["median_tpot_ms"], c1_out_tok_s=m1["output_throughput"],
            c16_out_tok_s=m16["output_throughput"], c16_ttft_ms=m16["median_ttft_ms"],
            c16_tpot_ms=m16["median_tpot_ms"], prefix_hit_ttft_ms=mp.get("median_ttft_ms"),
            errors=m1.get("errors", 0) + m16.get("errors", 0) + mp.get("errors", 0),
        )
    finally:
        sampler.stop.set()
        sampler.join()
        res["peak_rss_gb"] = sampler.peak / 1e9
        stop_server(proc)
        res["wall_s"] = time.perf_counter() - t_launch
        time.sleep(2.0)  # let the port and the memory go before the next server
    return res


def rows(c16_prompts: int = 64, input_len: int = 256) -> list[tuple[str, str, bool]]:
    """(key, label, higher is better) of the table, labelled with the run's request count and prompt length."""
    return [
        ("c16_out_tok_s", f"HTTP, concurrency 16, {c16_prompts} requests: output tokens/s", True),
        ("c16_ttft_ms", "HTTP, concurrency 16: median TTFT (ms)", False),
        ("c1_ttft_ms", f"HTTP, one stream: median TTFT, {input_len}-token prompt (ms)", False),
        ("c1_tpot_ms", "HTTP, one stream: median time per output token (ms)", False),
        ("prefix_hit_ttft_ms", "shared 1,024-token prefix + 64 new tokens, cache hit: median TTFT (ms)", False),
        ("start_s", "server start until /health answers (s)", False),
        ("peak_rss_gb", "peak RSS of the server processes (GB)", False),
        ("idle_rss_gb", "RSS after start, idle (GB)", False),
    ]


def table(results: list[dict], row_specs: list[tuple[str, str, bool]] | None = None) -> str:
    ref = results[0]
    head = "| figure | " + " | ".join(r["server"] for r in results) + " | " + \
        " | ".join(f"{ref['server']} vs {r['server']}" for r in results[1:]) + " |"
    if len(results) == 1:
        head = f"| figure | {ref['server']} |"
    lines = [head, "|" + "---|" * (1 + len(results) + len(results) - 1)]
    for key, label, higher in row_specs or rows():
        vals = [r.get(key) for r in results]
        cells = [f"{v:,.1f}" if isinstance(v, float) and v >= 10 else (f"{v:.2f}" if isinstance(v, float) else "—")
                 for v in vals]
        ratios = []
        for r in results[1:]:
            a, b = ref.get(key), r.get(key)
            if isinstance(a, float) and isinstance(b, float) and a > 0 and b > 0:
                x = a / b if higher else b / a
                ratios.append(f"{x:.2f}x {'better' if x >= 1 else 'worse'}")
            else:
                ratios.append("—")
        lines.append(f"| {label} | " + " | ".join(cells) + " |" + "".join(f" {x} |" for x in ratios))
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", nargs=3, action="append", metavar=("NAME", "URL", "COMMAND"), required=True)
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name (all servers)")
    p.add_argument("--out", default=f"bench_results/side-by-side-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--c1-prompts", type=int, default=8, help="requests of the one-stream workload")
    p.add_argument("--c16-prompts", type=int, default=64, help="requests of the concurrency-16 workload")
    p.add_argument("--input-len", type=int, default=256, help="prompt tokens of the random workloads")
    p.add_argument("--output-len", type=int, default=128, help="output tokens of the random workloads")
    p.add_argument("--no-prefix", dest="prefix", action="store_false", help="skip the shared-prefix workload")
    args = p.parse_args()
    out = (ROOT / args.out) if not os.path.isabs(args.out) else Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for name, url, command in args.server:
        try:
            results.append(measure(name, url.rstrip("/"), command, args.model, out, args.start_timeout,
                                   args.c1_prompts, args.c16_prompts, args.prefix, args.input_len, args.output_len))
        except Exception as e:  # keep going: report what failed
            print(f"!! {name}: {type(e).__name__}: {e}", file=sys.stderr)
            results.append({"server": name, "command": command, "error": f"{type(e).__name__}: {e}"})
        (out / "results.json").write_text(json.dumps(results, indent=2))
    md = table(results, rows(args.c16_prompts, args.input_len))
    (out / "side_by_side.md").write_text(md + "\n")
    print(md)


if __name__ == "__main__":
    main()
