"""A/B/A overhead of the dashboard and prefix-cache diagnostics on a running server (issue 18).

    .venv/bin/python benchmarks/dashboard_ab.py --base-url http://127.0.0.1:8000 [--num-prompts 48]

Runs ``tinyvllm bench serve`` (random dataset, c=16) three times: A without a dashboard page and
without ``prefix_cache_debug``; B with ``/dashboard`` open in headless chromium (Debian's, driven by
playwright) and ``"prefix_cache_debug": true`` on every request; A again. Prints output throughput
and mean/median TPOT of each run and B's ratio to the mean of the two A runs.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tinyvllm.benchmarks import serve as bench  # noqa: E402

CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def run(args: argparse.Namespace, debug: bool) -> dict:
    argv = ["--base-url", args.base_url, "--dataset", "random", "--num-prompts", str(args.num_prompts),
            "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--max-concurrency", "16",
            "--seed", str(args.seed), "--disable-tqdm", "--no-plot"]
    if debug:
        argv += ["--extra-body", json.dumps({"prefix_cache_debug": True})]
    with contextlib.redirect_stdout(io.StringIO()):
        return bench.main(argv)


@contextlib.contextmanager
def dashboard_open(base_url: str):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=CHROMIUM_ARGS, headless=True)
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(base_url.rstrip("/") + "/dashboard")
        page.wait_for_function("document.getElementById('status').textContent !== 'connecting'", timeout=60000)
        try:
            yield page
        finally:
            steps = page.get_attribute("#batch", "data-steps")
            browser.close()
            print(f"  (dashboard page saw step #{steps})")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--num-prompts", type=int, default=48)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-warmup", action="store_true")
    args = ap.parse_args()
    if not args.no_warmup:
        run(args, False)  # warm-up (not reported)
    rows = []
    for label, on in (("A off", False), ("B dashboard+debug", True), ("A off", False)):
        if on:
            from concurrent.futures import ThreadPoolExecutor

            # playwright's sync API owns this thread's event loop; the load generator runs in another thread
            with dashboard_open(args.base_url), ThreadPoolExecutor(1) as pool:
                r = pool.submit(run, args, True).result()
        else:
            r = run(args, False)
        rows.append((label, r["output_throughput"], r["mean_tpot_ms"], r["median_tpot_ms"], r["completed"]))
        print(f"{label:<20} output {r['output_throughput']:7.2f} tok/s   TPOT mean {r['mean_tpot_ms']:7.1f} ms  "
              f"median {r['median_tpot_ms']:7.1f} ms   completed {r['completed']}", flush=True)
    a_tput = (rows[0][1] + rows[2][1]) / 2
    a_tpot = (rows[0][2] + rows[2][2]) / 2
    print(f"B / mean(A): throughput {rows[1][1] / a_tput:.3f}, mean TPOT {rows[1][2] / a_tpot:.3f}; "
          f"A run-to-run: throughput {rows[2][1] / rows[0][1]:.3f}, TPOT {rows[2][2] / rows[0][2]:.3f}")


if __name__ == "__main__":
    main()
