#!/usr/bin/env python3
"""Decode attention against the memory floor (issue 15): B sequences x CTX cached positions, one query
row each, SmolLM2's heads (9 query / 3 KV heads, D 64), bf16 paged KV of 16-token blocks in a random
block order, L layers' caches rotated so that the KV streams from memory as in a real step.

    NT=2 B=4 CTX=4096 L=30 .venv/bin/python benchmarks/attention_decode_micro.py

Prints the best of 5 passes over the L layers for the tiled kernel with its software prefetch on and
off, the KV bytes read per second, and the floor: a float32 torch.sum over 200 MB on the same threads
(a pure sequential read). Ratios within one run are what to compare.
"""

import os
import time

import torch

from tinyvllm.kernels.cpu import cpu_kernels


def main() -> None:
    k = cpu_kernels()
    torch.manual_seed(0)
    nt, b, ctx, layers = (int(os.environ.get(n, d)) for n, d in (("NT", 2), ("B", 4), ("CTX", 4096), ("L", 30)))
    torch.set_num_threads(nt)
    hq, hk, d, bs = 9, 3, 64, 16
    nblk = (ctx + 1 + bs - 1) // bs
    bt = torch.randperm(b * nblk).view(b, nblk).to(torch.int64).contiguous()
    caches = [(torch.randn(b * nblk, bs, hk, d).to(torch.bfloat16), torch.randn(b * nblk, bs, hk, d).to(torch.bfloat16))
              for _ in range(layers)]
    q = torch.randn(b, hq, d)
    seq = torch.arange(b, dtype=torch.int64)
    pos = torch.full((b,), ctx, dtype=torch.int64)
    kv_gb = layers * b * (ctx + 1) * hk * d * 2 * 2 / 1e9

    def best(fn, n=5):
        fn()
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return min(ts)

    x = torch.randn(50_000_000)
    floor = x.numel() * 4 / best(x.sum) / 1e9
    print(f"B={b} CTX={ctx} L={layers} NT={nt}: {kv_gb:.2f} GB of KV per pass; floor (torch.sum) {floor:.1f} GB/s")
    for rep in range(2):
        for pf in (True, False):
            k.set_prefetch(pf)
            t = best(lambda: [k.paged_attention(q, kc, vc, bt, seq, pos, 0.125) for kc, vc in caches])
            print(f"  prefetch {'on ' if pf else 'off'}  {t * 1e3:8.2f} ms  {kv_gb / t:6.2f} GB/s  "
                  f"({kv_gb / t / floor:.0%} of the floor)")
    k.set_prefetch(True)


if __name__ == "__main__":
    main()
