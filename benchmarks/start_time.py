"""Time ``tinyvllm serve`` from exec until ``/health`` answers 200 (warm caches), several runs, median.

Usage: ``python benchmarks/start_time.py ROOT [N] [-- extra serve flags]``: ROOT is a checkout with its
``.venv``; compare two checkouts (A/B) in one sitting, since the shared machine drifts.
"""

from __future__ import annotations

import signal
import socket
import statistics
import subprocess
import sys
import time

import httpx


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def time_start(root: str, extra: list[str], timeout: float = 120.0) -> float:
    port = _free_port()
    t0 = time.monotonic()
    proc = subprocess.Popen([f"{root}/.venv/bin/python", "-m", "tinyvllm.entrypoints.cli", "serve", "--port",
                             str(port), *extra], cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < timeout:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.monotonic() - t0
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode}")
            time.sleep(0.02)
        raise TimeoutError(f"no /health within {timeout:.0f} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    args = sys.argv[1:]
    extra = args[args.index("--") + 1:] if "--" in args else []
    args = args[:args.index("--")] if "--" in args else args
    root, n = args[0], int(args[1]) if len(args) > 1 else 5
    times = [time_start(root, extra) for _ in range(n)]
    print(" ".join(f"{t:.2f}" for t in times), f"median {statistics.median(times):.2f} s")


if __name__ == "__main__":
    main()
