"""A/B of ``gemm_bf16``'s two kernels (AMX tiles vs VDPBF16PS) on SmolLM2-135M's projection shapes.

    .venv/bin/python benchmarks/gemm_amx_ab.py THREADS M [M ...]

For each M, the four linears of one layer (N x K = 960 x 576 QKV, 576 x 576 O, 3072 x 576 gate/up,
576 x 1536 down) are timed call by call, the two kernels alternated (``set_amx_gemm``), best of 15
calls each; prints per-shape ms, the sum and GFLOP/s (2 M N K per linear).
"""
import sys
import time

import torch

from tinyvllm.kernels.cpu import cpu_kernels

K = cpu_kernels()
torch.set_num_threads(int(sys.argv[1]))
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
for M in [int(a) for a in sys.argv[2:]]:
    best = {False: [1e9] * 4, True: [1e9] * 4}
    data = [(K.gemm_pack_bf16(torch.randn(n, k).bfloat16()), torch.randn(M, k).bfloat16(), n, k) for n, k in SHAPES]
    for _ in range(15):
        for amx in (False, True):
            K.set_amx_gemm(amx)
            for j, (p, x, n, k) in enumerate(data):
                t = time.perf_counter()
                K.gemm_bf16(x, p, n, k, None)
                best[amx][j] = min(best[amx][j], time.perf_counter() - t)
    K.set_amx_gemm(True)
    flop = sum(2 * M * n * k for n, k in SHAPES)
    for amx in (False, True):
        tot = sum(best[amx])
        print(f"T={sys.argv[1]} M={M} {'amx' if amx else 'dp '} per-shape ms {[round(b * 1e3, 3) for b in best[amx]]} "
              f"sum {tot * 1e3:.3f} ms {flop / tot / 1e9:.0f} GFLOP/s")
