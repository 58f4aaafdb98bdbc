#!/usr/bin/env python3
"""Batch-1 decode A/B of ``gemm_bf16``'s two kernels (AMX tiles vs VDPBF16PS), alternated in one process.

    NT=1 .venv/bin/python benchmarks/decode_gemm_ab.py            # 1 thread: least scheduling noise
    NT=2 B=1 CTX=256 N=60 .venv/bin/python benchmarks/decode_gemm_ab.py

Part 1, the linears alone at M = B: SmolLM2-135M's shapes (N x K: QKV 960 x 576, O 576 x 576,
gate/up 3072 x 576, down 576 x 1536) with 30 copies of each, as in the model, plus the lm_head
(49152 x 576), so the ~270 MB of weights stream from memory as they do in a decode step (one copy
of each would sit in cache); per-shape sums of the fastest pass, kernels alternated pass by pass.
Part 2, the model's forward step (30 layers + logits, random K/V at CTX cached tokens), the kernels
alternated step by step (``set_amx_gemm``), so a load burst on a shared machine hits both alike;
prints min / p10 / p25 / median step time per kernel. Env: NT threads, B sequences, CTX, N steps.
"""
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # this checkout
from tinyvllm.attention.selector import get_attn_backend  # noqa: E402
from tinyvllm.kernels.cpu import cpu_kernels  # noqa: E402
from tinyvllm.model.loader import resolve_model  # noqa: E402
from tinyvllm.model.weights import load_model  # noqa: E402

K = cpu_kernels()
if K is None or not K.has_amx_gemm():
    sys.exit("needs the C++ kernels built with AMX-BF16 on a CPU that has it")
torch.set_num_threads(int(os.environ.get("NT", "2")))
B, CTX, N = int(os.environ.get("B", "1")), int(os.environ.get("CTX", "256")), int(os.environ.get("N", "40"))
KERNELS = {"vdpbf16ps": False, "amx": True}


def quantiles(v):
    s = sorted(v)
    return f"min {s[0]:7.2f}  p10 {s[len(s) // 10]:7.2f}  p25 {s[len(s) // 4]:7.2f}  med {s[len(s) // 2]:7.2f}"


# Part 1: the linears at M = B, streaming.
SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536)}
g = torch.Generator().manual_seed(0)
weights = [(name, K.gemm_pack_bf16((torch.randn(n, k, generator=g) * 0.05).bfloat16()), n, k)
           for _ in range(30) for name, (n, k) in SHAPES.items()]
weights.append(("lm_head", K.gemm_pack_bf16((torch.randn(49152, 576, generator=g) * 0.05).bfloat16()), 49152, 576))
xs = {k: torch.randn(B, k, generator=g).bfloat16() for k in (576, 1536)}
best = {kern: {} for kern in KERNELS}
for _ in range(max(5, N // 4)):
    for kern, amx in KERNELS.items():
        K.set_amx_gemm(amx)
        tot: dict = {}
        for name, p, n, k in weights:
            t = time.perf_counter()
            K.gemm_bf16(xs[k], p, n, k, None)
            tot[name] = tot.get(name, 0.0) + time.perf_counter() - t
        for name, v in tot.items():
            best[kern][name] = min(best[kern].get(name, 1e9), v)
K.set_amx_gemm(True)
print(f"linears at M={B}, NT={torch.get_num_threads()}: ms per step (sum of 30 layers), fastest pass")
for kern in KERNELS:
    row = "  ".join(f"{name} {v * 1e3:6.2f}" for name, v in best[kern].items())
    print(f"  {kern:9s} {row}  total {sum(best[kern].values()) * 1e3:6.2f} ms")
del weights

# Part 2: the model's decode step.
m = load_model(resolve_model("SmolLM2-135M-Instruct").model_dir, torch.bfloat16)
cfg, bs = m.config, 16
nb = (CTX + 1 + bs) // bs + 1
kv = [torch.randn(2, B * nb, bs, cfg.num_key_value_heads, cfg.head_dim, dtype=torch.bfloat16)
      for _ in range(cfg.num_hidden_layers)]
tables = [list(range(i * nb, (i + 1) * nb)) for i in range(B)]
be = get_attn_backend("cpu", torch.bfloat16)
m.bind_attn_backend(be)


def step():
    md = be.build_metadata([1] * B, [CTX + 1] * B, tables, bs)
    with torch.inference_mode():
        return m.compute_logits(m(torch.randint(0, 1000, (B,)), torch.full((B,), CTX), kv, md))


res = {kern: [] for kern in KERNELS}
for i in range(N + 2):
    for kern, amx in KERNELS.items():
        K.set_amx_gemm(amx)
        t = time.perf_counter()
        step()
        if i >= 2:
            res[kern].append((time.perf_counter() - t) * 1e3)
K.set_amx_gemm(True)
print(f"decode step, B={B} CTX={CTX} NT={torch.get_num_threads()}, {N} steps each, alternated (ms):")
for kern, v in res.items():
    print(f"  {kern:9s} {quantiles(v)}")
