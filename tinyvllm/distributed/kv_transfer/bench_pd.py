"""Measure the P/D handoff: ``python -m tinyvllm.distributed.kv_transfer.bench_pd [--lens 128 512 960] [-n 20]``.

Starts a prefill and a decode engine (``tinyvllm serve --kv-transfer-config ...``, the embedded model in
bfloat16) on 127.0.0.1 and, per prompt length, runs ``-n`` requests one at a time, as the router does:

1. ``POST /v1/completions`` to the prefill engine with ``kv_transfer_params: {"do_remote_decode": true}``,
   ``max_tokens: 1``; *prefill done* is when its response arrives;
2. the same request, streamed, with the returned ``kv_transfer_params``, to the decode engine; *first decode
   token* is when its first token arrives.

Reported per length: the handoff latency (2 - 1) p50 / p99, the single engine's TTFT for the same prompt
(the decode engine, no params: it computes the prompt) p50, the KV bytes pulled per request and the pull rate
(bytes / the decode engine's transfer time, from its ``/debug/stats``), against the loopback rates of the
same bytes: ZMQ over TCP on 127.0.0.1 and an in-memory copy (``torch`` ``clone``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"


def _serve(tmp: Path, name: str, kv: dict, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    port_file = tmp / f"{name}.port"
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--model", MODEL, "--dtype", "bfloat16",
           "--max-model-len", "1024", "--kv-cache-memory", "256MiB", "--port", "0", "--port-file", str(port_file),
           "--kv-transfer-config", json.dumps(kv)]
    log = open(tmp / f"{name}.log", "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {})))
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited: {(tmp / f'{name}.log').read_text()[-2000:]}")
        if port_file.exists():
            base = f"http://127.0.0.1:{int(port_file.read_text())}"
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return proc, base
            except httpx.HTTPError:
                pass
        time.sleep(0.3)
    raise RuntimeError(f"{name} did not start")


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(round(q * (len(s) - 1))))]


def _first_token_s(base: str, body: dict, t0: float | None = None) -> float:
    """Seconds from ``t0`` (default: now) to the first streamed token of ``body``."""
    t0 = time.perf_counter() if t0 is None else t0
    with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token")


def loopback_rates(nbytes: int, repeat: int = 20) -> tuple[float, float]:
    """(ZMQ TCP on 127.0.0.1, in-memory copy) rates in MB/s for a ``nbytes`` message."""
    import torch
    import zmq

    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    port = a.bind_to_random_port("tcp://127.0.0.1")
    b.connect(f"tcp://127.0.0.1:{port}")
    buf = torch.randn(nbytes // 2, dtype=torch.bfloat16).view(torch.uint8).numpy()

    def sink() -> None:
        for _ in range(repeat + 1):
            b.recv(copy=False)
            b.send(b"")

    t = threading.Thread(target=sink)
    t.start()
    a.send(buf, copy=False)
    a.recv()
    t0 = time.perf_counter()
    for _ in range(repeat):
        a.send(buf, copy=False)
        a.recv()
    zmq_rate = nbytes * repeat / (time.perf_counter() - t0) / 1e6
    t.join()
    a.close(0)
    b.close(0)
    ctx.term()
    src = torch.from_numpy(buf)
    src.clone()
    t0 = time.perf_counter()
    for _ in range(repeat):
        src.clone()
    return zmq_rate, nbytes * repeat / (time.perf_counter() - t0) / 1e6


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 960], help="prompt lengths (tokens)")
    ap.add_argument("-n", type=int, default=20, help="requests per length")
    args = ap.parse_args(argv)
    tmp = Path(tempfile.mkdtemp(prefix="bench_pd_"))
    procs = []
    try:
        p_proc, p_base = _serve(tmp, "prefill", {"kv_connector": "ZmqConnector", "kv_role": "kv_producer"})
        procs.append(p_proc)
        d_proc, d_base = _serve(tmp, "decode", {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer"})
        procs.append(d_proc)
        print("| prompt tokens | handoff p50 (ms) | handoff p99 (ms) | single-engine TTFT p50 (ms) | "
              "KV bytes / request | pull MB/s | ZMQ loopback MB/s | memcpy MB/s |")
        print("|---:|---:|---:|---:|---:|---:|---:|---:|")
        for n_tok in args.lens:
            handoffs, ttfts = [], []
            s0 = httpx.get(d_base + "/debug/stats").json()
            for i in range(args.n):
                prompt = [1000 + (n_tok * 1009 + i * 7919 + j * 104729) % 40000 for j in range(n_tok)]  # no prefix hits
                body = {"model": MODEL, "prompt": prompt, "temperature": 0, "max_tokens": 2}
                r = httpx.post(p_base + "/v1/completions", timeout=120,
                               json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}})
                r.raise_for_status()
                t_prefill_done = time.perf_counter()
                params = r.json()["kv_transfer_params"]
                handoffs.append(_first_token_s(d_base, {**body, "kv_transfer_params": params}, t_prefill_done))
                ttfts.append(_first_token_s(d_base, {**body, "prompt": [t + 1 for t in prompt]}))
            s1 = httpx.get(d_base + "/debug/stats").json()
            pulled = s1["kv_transfer_recv_requests"] - s0["kv_transfer_recv_requests"]
            nbytes = (s1["kv_transfer_recv_bytes"] - s0["kv_transfer_recv_bytes"]) / max(pulled, 1)
            secs = s1["kv_transfer_recv_seconds"] - s0["kv_transfer_recv_seconds"]
            failed = s1["kv_transfer_failed_requests"] - s0["kv_transfer_failed_requests"]
            zmq_rate, mem_rate = loopback_rates(int(nbytes))
            print(f"| {n_tok} | {_pct(handoffs, .5) * 1e3:.1f} | {_pct(handoffs, .99) * 1e3:.1f} | "
                  f"{_pct(ttfts, .5) * 1e3:.1f} | {nbytes / 1e6:.2f} MB | "
                  f"{nbytes * pulled / secs / 1e6 if secs else 0:.0f} | {zmq_rate:.0f} | {mem_rate:.0f} |"
                  + (f" ({failed} pulls failed)" if failed else ""), flush=True)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(20)
            except subprocess.TimeoutExpired:
                p.kill()


if __name__ == "__main__":
    main()
