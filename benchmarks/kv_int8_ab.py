"""A/B/A sitting of ``bench prefill`` over the KV dtypes and int8 kernels, in one process (issue 39).

Arms, interleaved round by round (the machine is shared: medians per arm, with the load average):
``bf16`` (the bf16 cache), ``int8/bf16qk`` (int8 cache on bf16 tiles: the kernel before the int8
Q K^T), ``int8`` (the int8 Q K^T kernel, attention_int8.h: P V in int8 on the vector path, bf16 on
AMX), optionally ``int8/exp4`` (int8 Q K^T with the bf16 kernel's degree-4 exp2, and so bf16 P V) and ``int8/pv16``
(P V in bf16 on the vector path too). Each arm is ``tinyvllm.benchmarks.prefill.run_prefill``, the
function behind ``tinyvllm bench prefill``, with the same arguments.

    PYTHONPATH=. python benchmarks/kv_int8_ab.py --context 5000 --chunk 512 --rounds 3
    PYTHONPATH=. python benchmarks/kv_int8_ab.py --context 4096 --chunk 1 --batch 16 --rounds 3
    PYTHONPATH=. python benchmarks/kv_int8_ab.py --no-amx --arms bf16 int8/pv16 int8   # the vector path
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch

from kv_quality import set_int8_variant
from tinyvllm.attention.selector import get_attn_backend
from tinyvllm.benchmarks.prefill import run_prefill
from tinyvllm.kernels.cpu import cpu_kernels
from tinyvllm.model.loader import resolve_model
from tinyvllm.model.weights import load_model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--num-iters", type=int, default=3)
    ap.add_argument("--arms", nargs="+", default=["bf16", "int8/bf16qk", "int8"])
    ap.add_argument("--no-amx", action="store_true", help="the AVX-512 vector path instead of AMX tiles")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    K = cpu_kernels()
    model = load_model(resolve_model("SmolLM2-135M-Instruct").model_dir, torch.bfloat16)
    backend = get_attn_backend("cpu", torch.bfloat16)
    model.bind_attn_backend(backend)
    if args.no_amx:
        K.set_amx_attention(False)
    res: dict[str, dict[str, list[float]]] = {a: {"step_ms": [], "attn_ms": []} for a in args.arms}
    loads = [os.getloadavg()[0]]
    ceil = {}
    try:
        for _ in range(args.rounds):
            for arm in args.arms:
                kv = set_int8_variant(arm)
                r = run_prefill(model, backend, K, args.context, args.chunk, args.batch,
                                num_iters=args.num_iters, kv_cache_dtype="bfloat16" if kv == "bf16" else kv)
                res[arm]["step_ms"].append(r["step_s"] * 1e3)
                res[arm]["attn_ms"].append(r["attention_s"] * 1e3)
                ceil = {k: r[k] for k in ("ceiling_gflops", "dpbf16_ceiling_gflops", "amx_ceiling_gflops",
                                          "vnni_ceiling_gflops", "amx_int8_ceiling_gflops", "kernel")}
                loads.append(os.getloadavg()[0])
    finally:
        K.set_int8_attention(True)
        K.set_amx_attention(True)
    base = statistics.median(res[args.arms[0]]["attn_ms"])
    print(f"context {args.context} chunk {args.chunk} batch {args.batch}, {torch.get_num_threads()} threads, "
          f"{'vector' if args.no_amx else ceil.get('kernel')}; load {min(loads):.1f}-{max(loads):.1f}; "
          f"{args.rounds} rounds x {args.num_iters} steps")
    print(f"| arm | step ms (median; each round) | attention ms (median; each round) | attention vs {args.arms[0]} |")
    print("|---|---|---|---|")
    for arm, v in res.items():
        s, a = statistics.median(v["step_ms"]), statistics.median(v["attn_ms"])
        print(f"| {arm} | {s:.1f} ({' / '.join(f'{x:.0f}' for x in v['step_ms'])}) | "
              f"{a:.1f} ({' / '.join(f'{x:.0f}' for x in v['attn_ms'])}) | {base / a:.2f}x |")
    print("ceilings GFLOP/s (last round):", {k: (round(v, 1) if isinstance(v, float) else v) for k, v in ceil.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "loads": loads, "arms": res, "ceilings": ceil}, f, indent=2)


if __name__ == "__main__":
    main()
