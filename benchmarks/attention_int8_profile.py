"""Where the tiled prefill attention's time goes, bf16 cache against int8 cache (issue 39).

One layer of SmolLM2-135M's attention (9 query heads, 3 KV heads, head_dim 64) for a ``--chunk``-token
prefill chunk over ``--context`` cached tokens, called directly (``paged_attention``, no rotary / KV
write), on a random cache. Configurations, interleaved round by round (the machine is shared: medians):

* ``bf16``: the bf16 cache (attention_tiled; AMX-BF16 where present, else ``vdpbf16ps``);
* ``int8 bf16-QK``: the int8 cache on bf16 tiles (attention_tiled<int8>: K unscaled to bf16, V
  dequantized while packing), the kernel before the int8 Q K^T;
* ``int8``: the int8 Q K^T kernel (attention_int8.h: AMX-INT8 TDPBSSD / AVX512-VNNI VPDPBUSD);
* ``int8 exp4``: the same with the bf16 kernel's degree-4 exp2 instead of the degree-3 one;
* ``int8 -X``: the int8 kernel with stage X skipped (``set_int8_attention(True, profile)``: outputs
  wrong, timing only): the stage's cost is the difference to ``int8``.

Both engines (AMX and the AVX-512 vector path) unless ``--amx-only`` / ``--vector-only``.
CPU time (``time.process_time``, all threads) is reported beside the wall time: on a shared machine it
is the steadier measure (time the threads were descheduled is not in it). The softmax's share comes
from skipping it; the dot-product ceilings from ``bf16_dot_ceiling`` etc.

    PYTHONPATH=. python benchmarks/attention_int8_profile.py --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from tinyvllm.attention import kv_quant
from tinyvllm.kernels.cpu import cpu_kernels

SKIPS = {"-QK": 1, "-softmax": 2, "-PV": 4, "-pack": 8}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=5000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-profile", action="store_true", help="only the whole kernels, no skipped stages")
    ap.add_argument("--amx-only", action="store_true")
    ap.add_argument("--vector-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    K = cpu_kernels()
    hq, hk, d, bs = 9, 3, 64, 16
    ctx, T = args.context, args.chunk
    g = torch.Generator().manual_seed(0)
    nb = (ctx + T) // bs + 1
    kv = torch.randn(2, nb * bs, hk, d, generator=g)
    bf = kv.bfloat16().view(2, nb, bs, hk, d)
    i8 = kv_quant.quantize(kv, "int8", torch.bfloat16).view(2, nb, bs, hk, d + 2)
    q = torch.randn(T, hq, d, generator=g).bfloat16().float()
    bt = torch.arange(nb)[None].long()
    seq = torch.zeros(T, dtype=torch.int64)
    pos = torch.arange(ctx, ctx + T)
    engines = []
    if K.has_amx_attention() and not args.vector_only:
        engines.append("amx")
    if not args.amx_only:
        engines.append("vector")
    configs = []
    for e in engines:
        configs += [(e, "bf16", True, 0), (e, "int8 bf16-QK", False, 0), (e, "int8", True, 0), (e, "int8 exp4", True, 0)]
        if not args.no_profile:
            configs += [(e, "int8 " + name, True, mask) for name, mask in SKIPS.items()]
    times: dict[tuple[str, str], list[float]] = {(c[0], c[1]): [] for c in configs}
    cpu: dict[tuple[str, str], list[float]] = {(c[0], c[1]): [] for c in configs}  # process CPU time (all threads)
    flop = 4 * d * hq * (T * ctx + T * (T + 1) // 2)
    loads = [os.getloadavg()[0]]
    try:
        for _ in range(args.rounds):
            for eng, name, on, mask in configs:
                if K.has_amx_attention():
                    K.set_amx_attention(eng == "amx")
                K.set_int8_attention(on, mask, name != "int8 exp4")
                cache = bf if name == "bf16" else i8
                K.paged_attention(q[:64], cache[0], cache[1], bt, seq[:64], pos[:64], d ** -0.5)  # warm
                t, c = time.perf_counter(), time.process_time()
                K.paged_attention(q, cache[0], cache[1], bt, seq, pos, d ** -0.5)
                times[(eng, name)].append(time.perf_counter() - t)
                cpu[(eng, name)].append(time.process_time() - c)
            loads.append(os.getloadavg()[0])
    finally:
        K.set_int8_attention(True, 0)
        if K.has_amx_attention():
            K.set_amx_attention(True)
    ceil = {"bf16 vdpbf16ps": K.bf16_dot_ceiling(20000), "int8 VPDPBUSD": K.int8_dot_ceiling(20000)}
    if K.has_amx_attention():
        ceil.update({"AMX-BF16": K.amx_dot_ceiling(5000), "AMX-INT8": K.amx_int8_dot_ceiling(5000)})
    res = {"context": ctx, "chunk": T, "threads": torch.get_num_threads(), "rounds": args.rounds,
           "load_1min": loads, "ceilings_gflops": {k: v / 1e9 for k, v in ceil.items()}, "ms": {}}
    print(f"one layer, {hq}/{hk} heads x {d}, chunk {T} over {ctx}; {torch.get_num_threads()} threads; "
          f"load {min(loads):.1f}-{max(loads):.1f}; medians of {args.rounds}")
    print(f"{'engine':>7} {'config':>16} {'wall ms':>8} {'vs bf16':>7} {'CPU ms':>8} {'vs bf16':>7}")
    res["cpu_ms"] = {}
    for eng in engines:
        base = statistics.median(times[(eng, "bf16")])
        cbase = statistics.median(cpu[(eng, "bf16")])
        for (e, name), ts in times.items():
            if e != eng:
                continue
            m, cm = statistics.median(ts), statistics.median(cpu[(e, name)])
            res["ms"][f"{e} {name}"] = m * 1e3
            res["cpu_ms"][f"{e} {name}"] = cm * 1e3
            print(f"{e:>7} {name:>16} {m * 1e3:>8.2f} {base / m:>7.2f} {cm * 1e3:>8.2f} {cbase / cm:>7.2f}")
    print("ceilings (GFLOP/s):", {k: round(v / 1e9, 1) for k, v in ceil.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
