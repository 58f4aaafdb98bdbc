"""Decode step time at TP=1 and TP=2 and the all-reduce's share (issue 38): the embedded SmolLM2, in-process
engine (the ranks are processes), greedy, batch 1 and 16, 128-token random prompts.

Per (tp, batch): prefill the batch, then time ``--steps`` decode-only steps (the engine's ``step()``, wall
clock, in the core), and read rank 0's seconds inside tensor collectives (all-reduce, all-gather) over those
steps (``MultiprocExecutor.comm_stats``: each call timed with ``perf_counter`` around the gloo op).

    PYTHONPATH=. python benchmarks/tp_step.py --dtype bfloat16 --steps 32
"""

from __future__ import annotations

import argparse
import json
import time


def measure(tp: int, batch: int, dtype: str, steps: int) -> dict:
    from tinyvllm import LLM, SamplingParams
    from tinyvllm.benchmarks.throughput import random_token_prompts

    llm = LLM("SmolLM2-135M-Instruct", dtype=dtype, tensor_parallel_size=tp, max_model_len=1024)
    eng = llm.llm_engine
    ex = eng.core.model_executor
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for p in random_token_prompts(batch, 128, eng.core.model.config.vocab_size, 0):
        eng.add_request(p, sp)
    while True:  # prefill (and a few decode steps to warm up)
        eng.step()
        if eng.core.last_iteration.num_prefill_tokens == 0:
            break
    for _ in range(3):
        eng.step()
    if tp > 1:
        ex.comm_stats()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step_s = (time.perf_counter() - t0) / steps
    comm_s, calls = ex.comm_stats() if tp > 1 else (0.0, 0)
    while eng.has_unfinished_requests():
        eng.step()
    eng.core.shutdown()
    return {"tp": tp, "batch": batch, "dtype": dtype, "decode_step_ms": round(step_s * 1e3, 2),
            "comm_ms_per_step": round(comm_s / steps * 1e3, 2), "collectives_per_step": calls / steps if tp > 1 else 0,
            "comm_share": round(comm_s / steps / step_s, 3) if tp > 1 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--batches", default="1,16")
    args = ap.parse_args()
    for batch in (int(b) for b in args.batches.split(",")):
        for tp in (1, 2, 1):  # A/B/A on a shared machine
            print(json.dumps(measure(tp, batch, args.dtype, args.steps)), flush=True)


if __name__ == "__main__":
    main()
