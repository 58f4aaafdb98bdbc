"""Micro-benchmark of the per-step and per-request costs added by issue 18 (no model, no server).

    .venv/bin/python benchmarks/kv_diagnostics_overhead.py

Prints microseconds per call of: the scheduler's KV-cost charge (per step, twice a step), the
prefix-cache classification (once per request, with the chain record full), the block-state map
(at most every 0.5 s) and a scheduler step with and without the new bookkeeping.
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent.parent / "tests")]

from test_scheduler import make_request, make_scheduler, runner_of  # noqa: E402

from tinyvllm.core.kv_diagnostics import block_state_map  # noqa: E402


def per_call(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    rng = random.Random(0)
    sched = make_scheduler(block_size=16, num_blocks=6000, budget=2048, max_num_seqs=16)
    shared = [rng.randrange(64) for _ in range(512)]
    for i in range(300):  # fill the chain record (256) with prompts sharing a 512-token prefix
        sched.add_request(make_request(f"w{i}", shared + [rng.randrange(64) for _ in range(64)], max_tokens=1))
    runner = runner_of(sched)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    for i in range(16):  # 16 running requests of ~1000 tokens (64 blocks each), prefix shared
        sched.add_request(make_request(f"r{i}", shared + [rng.randrange(64) for _ in range(512)], max_tokens=10_000))
    for _ in range(3):
        out = sched.schedule()
        sched.update_from_output(out, runner.execute(out))
    print(f"running {len(sched.running)} requests, {sched.kv.num_owned_blocks()} owned blocks, "
          f"{len(sched.prefix_diag.chains)} chains recorded")
    print(f"_charge_kv (2x per step):            {per_call(sched._charge_kv, 2000):8.1f} us")
    probe = shared + [rng.randrange(64) for _ in range(64)]
    req = make_request("probe", probe)
    hashes = sched.kv._block_hashes("probe", probe, len(probe) // 16)
    diag = sched.prefix_diag
    print(f"diagnose, counted (1x per request):  {per_call(lambda: diag.diagnose(hashes, probe, 31), 2000):8.1f} us")
    print(f"diagnose, debug report:              {per_call(lambda: diag.diagnose(hashes, probe, 31, True), 2000):8.1f} us")
    pool = sched.kv.block_pool
    print(f"block_state_map, {pool.num_blocks} blocks (<= 2/s): {per_call(lambda: block_state_map(pool), 200):8.1f} us")

    sampled = {}

    def bare_step() -> None:  # schedule + update with every sequence sampling token 1 (no fake KV store)
        out = sched.schedule()
        sched.update_from_output(out, {rid: 1 for rid in out.num_scheduled_tokens})

    print(f"schedule + update, a decode step:    {per_call(bare_step, 300):8.1f} us")
    charge = sched._charge_kv
    sched._charge_kv = lambda: None
    print(f"  the same without the KV charge:    {per_call(bare_step, 300):8.1f} us")
    sched._charge_kv = charge
    del sampled
    del req


if __name__ == "__main__":
    main()
