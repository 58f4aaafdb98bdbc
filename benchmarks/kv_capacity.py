"""Concurrent long sessions per KV pool for each ``--kv-cache-dtype`` at a fixed ``--kv-cache-memory``
(issue 39).

For each KV dtype: start the engine (SmolLM2-135M, bf16) with ``--kv-cache-memory``, read the number of
KV blocks it allocated, and count the sessions of ``--session-len`` tokens the pool holds at once
(``num_blocks // ceil(session_len / block_size)``: each running request owns its blocks). With
``--verify``, submit that many sessions (random prompts, ``--output-len`` greedy tokens) and then one
more, and report the preemptions of each run (0 for the first, > 0 for the second shows the bound).

    .venv/bin/python benchmarks/kv_capacity.py --kv-cache-memory 1GiB --session-len 4096
    .venv/bin/python benchmarks/kv_capacity.py --kv-cache-memory 24MiB --session-len 512 --verify
"""

from __future__ import annotations

import argparse
import math
import random


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kv-cache-memory", default="1GiB")
    ap.add_argument("--session-len", type=int, default=4096)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv", nargs="+", default=["bfloat16", "int8", "fp8"])
    ap.add_argument("--verify", action="store_true")
    args = ap.parse_args()
    from tinyvllm import LLM, SamplingParams

    print("| KV dtype | KV blocks | tokens | sessions of %d tokens | vs bf16 |" % args.session_len
          + (" preemptions at n / n + 1 |" if args.verify else ""))
    print("|---|---|---|---|---|" + ("---|" if args.verify else ""))
    base = None
    model = None
    for kv in args.kv:
        llm = LLM("SmolLM2-135M-Instruct", dtype="bfloat16", kv_cache_dtype=kv, kv_cache_memory=args.kv_cache_memory,
                  block_size=args.block_size, max_num_seqs=256, _preloaded_model=model)
        model = llm.llm_engine.core.model
        nb = llm.llm_engine.core.num_blocks
        per = math.ceil((args.session_len + args.output_len) / args.block_size)
        n = nb // per
        base = base or n
        row = f"| {kv} | {nb} | {nb * args.block_size} | {n} | {n / base:.2f}x |"
        if args.verify:
            rng = random.Random(0)
            sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
            pre = []
            for count in (n, n + 1):
                before = llm.stats()["num_preemptions"]
                prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(args.session_len)]}
                           for _ in range(count)]
                llm.generate(prompts, sp)
                pre.append(llm.stats()["num_preemptions"] - before)
            row += f" {pre[0]} / {pre[1]} |"
        print(row, flush=True)
        del llm


if __name__ == "__main__":
    main()
