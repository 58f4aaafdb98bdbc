#!/usr/bin/env python3
"""Per-linear timing of gemm_gguf (native GGUF blocks, bf16 activations), gemm_gguf_q8 (int8
activations; not for Q6_K) and gemm_bf16 (dequantized, packed).

1. Tensors of the embedded SmolLM2 GGUF (Q4_1, Q8_0), M = 1, 8, 64, 512 rows.
2. ``--kquants``: random blocks (tinyvllm/benchmarks/random_gguf.py) of Llama-3.2-1B's linear shapes in
   Q4_K, Q6_K (and Q4_1, Q8_0 at the same shapes for comparison), M = 1, 8, 64. Each weight is
   replicated so the copies cycled through exceed ~96 MB (no cache residency), as in a decode step.

Usage: .venv/bin/python benchmarks/gguf_gemm_micro.py THREADS [--kquants] [--types Q4_K,Q6_K]
"""
import argparse, pathlib, sys, time
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import gguf, numpy as np, torch
from gguf.quants import dequantize
from tinyvllm.benchmarks.random_gguf import random_blocks
from tinyvllm.kernels.cpu import cpu_kernels
from tinyvllm.model.gguf_quant import repack
from tinyvllm.model.loader import _find_alias_gguf

ap = argparse.ArgumentParser()
ap.add_argument("threads", type=int)
ap.add_argument("--kquants", action="store_true", help="only part 2 (random K-quant blocks, 1B shapes)")
ap.add_argument("--types", default="Q4_K,Q6_K,Q4_1,Q8_0")
args = ap.parse_args()
k = cpu_kernels(); torch.set_num_threads(args.threads)


def bench(f, budget=1.5, nmax=200):
    f(); n = 0; t0 = time.perf_counter()
    while n < nmax and (n < 3 or time.perf_counter() - t0 < budget):
        f(); n += 1
    return (time.perf_counter() - t0) / n * 1e6


def run(label, qt, N, K, raw, Ms):
    w0 = repack(raw, qt, N, K, label)
    ws = [w0] + [repack(raw, qt, N, K, label) for _ in range(max(1, -(-(96 << 20) // w0.nbytes)) - 1)]
    ref = torch.from_numpy(dequantize(raw, gguf.GGMLQuantizationType[qt]).reshape(N, K)).to(torch.bfloat16)
    p0 = k.gemm_pack_bf16(ref)
    ps = [p0] + [p0.clone() for _ in range(max(1, -(-(96 << 20) // (N * K * 2))) - 1)]
    for M in Ms:
        x = torch.randn(M, K).to(torch.bfloat16)
        i = [0]
        def fq():
            w = ws[i[0] % len(ws)]; i[0] += 1; k.gemm_gguf(x, w.qs, w.scales, w.fmt, N, K)
        def f8():
            w = ws[i[0] % len(ws)]; i[0] += 1; k.gemm_gguf_q8(x, w.qs, w.scales, w.fmt, N, K)
        def fb():
            p = ps[i[0] % len(ps)]; i[0] += 1; k.gemm_bf16(x, p, N, K, None)
        tq, tb = bench(fq), bench(fb)
        t8 = bench(f8) if w0.fmt != 3 else float("nan")
        print(f"{label:24s} {qt:5s} N {N:6d} K {K:5d} M {M:4d}  gguf us {tq:9.1f}  q8 us {t8:9.1f}  bf16 us {tb:9.1f}  "
              f"gguf/bf16 {tq / tb:5.2f}  q8/bf16 {t8 / tb:5.2f}  ({w0.nbytes * 8 / (N * K):.1f} bits/w)", flush=True)


if not args.kquants:
    r = gguf.GGUFReader(str(_find_alias_gguf("SmolLM2-135M-Instruct")))
    ts = {t.name: t for t in r.tensors}
    for name in ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "token_embd.weight"]:
        t = ts[name]; K, N = (int(x) for x in t.shape[:2])
        run(name, t.tensor_type.name, N, K, t.data, (1, 8, 64, 512))
else:
    rng = np.random.default_rng(0)
    shapes = {"1B attn_qkv": (3072, 2048), "1B ffn_gate": (8192, 2048), "1B ffn_down": (2048, 8192)}
    for label, (N, K) in shapes.items():
        for qt in args.types.split(","):
            run(label, qt, N, K, random_blocks(rng, N, K, qt, K ** -0.5), (1, 8, 64))
