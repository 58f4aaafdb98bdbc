#!/usr/bin/env python3
"""Per-linear timing of gemm_gguf (native GGUF blocks) vs gemm_bf16 (dequantized, packed) on tensors of the
embedded SmolLM2 GGUF, for M = 1, 8, 64, 512 rows.  Usage: .venv/bin/python benchmarks/gguf_gemm_micro.py THREADS"""
import sys, pathlib; sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import gguf, numpy as np, torch, time
from gguf.quants import dequantize
from tinyvllm.model.loader import _find_alias_gguf
from tinyvllm.model.gguf_quant import repack
from tinyvllm.kernels.cpu import cpu_kernels
k = cpu_kernels(); import sys; torch.set_num_threads(int(sys.argv[1]))
r = gguf.GGUFReader(str(_find_alias_gguf('SmolLM2-135M-Instruct')))
ts = {t.name: t for t in r.tensors}
def bench(f, n=200):
    f(); t0=time.perf_counter()
    for _ in range(n): f()
    return (time.perf_counter()-t0)/n*1e6
for name in ["blk.0.ffn_gate.weight", "blk.0.ffn_down.weight", "token_embd.weight"]:
    t = ts[name]; K, N = (int(x) for x in t.shape[:2]); qt = t.tensor_type.name
    # replicate across 30 "layers" to defeat caches (L3 300MB... use 8 copies)
    ws = [repack(t.data, qt, N, K, name) for _ in range(4 if N<10000 else 1)]
    ref = torch.from_numpy(dequantize(t.data, t.tensor_type).reshape(N, K)).to(torch.bfloat16)
    ps = [k.gemm_pack_bf16(ref) for _ in range(len(ws))]
    for M in (1, 8, 64, 512):
        x = torch.randn(M, K).to(torch.bfloat16)
        i=[0]
        def fq():
            w=ws[i[0]%len(ws)]; i[0]+=1; k.gemm_gguf(x, w.qs, w.scales, w.fmt, N, K)
        def fb():
            p=ps[i[0]%len(ps)]; i[0]+=1; k.gemm_bf16(x, p, N, K, None)
        n = 200 if M < 64 else 20
        print(name, qt, N, K, "M", M, "gguf us %.1f  bf16 us %.1f" % (bench(fq, n), bench(fb, n)))
