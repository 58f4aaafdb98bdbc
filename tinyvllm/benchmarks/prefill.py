"""``tinyvllm bench prefill``: one forward step of ``--chunk`` new tokens per sequence over
``--context`` cached tokens, in-process on the CPU backend (the long-context prefill of an agent
turn whose history comes from the prefix cache; ``--chunk 1`` is a decode step at that context).

The model runs on a paged KV cache filled with random bf16 values (timing only: the outputs are not
checked). Per step it reports the wall time, the time spent in the fused rotary + KV write + attention
kernel (all layers), the attention's achieved FLOP/s against the measured ceiling of the tiled kernel's
bf16 dot-product loop (``amx_dot_ceiling`` where it runs on AMX tiles, else ``bf16_dot_ceiling``, the
``vdpbf16ps`` loop; both in ``cpu_kernel.cpp``), and the KV bytes read per second.

    tinyvllm bench prefill --context 5000 --chunk 512            # the issue-15 shape
    tinyvllm bench prefill --context 4096 --chunk 1 --batch 16   # decode at long context
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any


def add_prefill_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="SmolLM2-135M-Instruct", help="model alias or directory (bf16 weights)")
    p.add_argument("--context", type=int, default=5000, help="cached tokens before the chunk, per sequence")
    p.add_argument("--chunk", type=int, default=512, help="new tokens per sequence in the step (1: decode)")
    p.add_argument("--batch", type=int, default=1, help="sequences in the step")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    p.add_argument("--num-iters", type=int, default=5, help="timed steps (after one warm-up step)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "bfloat16", "int8", "fp8", "fp8_e4m3"),
                   help="KV cache element type (auto = bfloat16; int8/fp8: quantized, docs/kv-cache-dtype.md)")
    p.add_argument("--result-file", default=None, help="write the result as JSON here")


def attention_flops(context: int, chunk: int, batch: int, num_heads: int, head_dim: int, layers: int) -> int:
    """FLOP of causal attention for the step: each new row at position ``context + i`` attends over
    ``context + i + 1`` positions with ``2 * head_dim`` multiply-adds per position and query head
    (``Q K^T`` and ``P V``), 2 FLOP each. Returns an int (FLOP per step, all layers)."""
    positions = chunk * context + chunk * (chunk + 1) // 2  # sum over the rows of their context length
    return 4 * head_dim * num_heads * positions * batch * layers


def kv_bytes(context: int, chunk: int, batch: int, num_kv_heads: int, head_dim: int, layers: int,
             elem_bytes: int = 2) -> int:
    """Bytes of K and V the step must read at least once (every cached position of every sequence,
    each KV head, all layers)."""
    return 2 * (context + chunk) * num_kv_heads * head_dim * elem_bytes * batch * layers


def run_prefill(model: Any, backend: Any, kernels: Any, context: int, chunk: int, batch: int = 1,
                block_size: int = 16, num_iters: int = 5, seed: int = 0, kv_cache_dtype: str = "auto"
                ) -> dict[str, Any]:
    """Time ``num_iters`` steps (after a warm-up) of ``model`` bound to the C++ ``backend``.

    Returns:
        dict: ``step_s`` (median seconds per step), ``step_min_s``, ``attention_s`` (median seconds in
        ``rope_cache_attention`` per step), ``attention_gflops``, ``kernel`` (amx, avx512-bf16 or
        row), ``ceiling_gflops`` (that kernel's dot-product loop, measured in this run; both loops'
        in ``amx_ceiling_gflops`` / ``dpbf16_ceiling_gflops``), ``attention_fraction_of_ceiling``,
        ``kv_gb_per_s`` and the shape; ``kv_cache_dtype`` and, measured in this run, the int8 dot-product
        ceilings ``vnni_ceiling_gflops`` (VPDPBUSD) and ``amx_int8_ceiling_gflops`` (TDPBSSD; 0 where
        absent) that an int8 Q K^T could reach (GOP/s, 2 per multiply-add).
    """
    import torch

    from tinyvllm.attention import kv_quant

    kind = kv_quant.canonical_kv_cache_dtype(kv_cache_dtype)
    kind = "bfloat16" if kind == "auto" else kind
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    nb = (context + chunk + block_size - 1) // block_size

    def layer_cache() -> torch.Tensor:
        x = torch.randn(2, batch * nb, block_size, cfg.num_key_value_heads, cfg.head_dim, generator=g)
        return x.to(torch.bfloat16) if kind == "bfloat16" else kv_quant.quantize(x, kind, torch.bfloat16)

    kv = [layer_cache() for _ in range(cfg.num_hidden_layers)]
    tables = [list(range(i * nb, (i + 1) * nb)) for i in range(batch)]
    attn_s = [0.0]
    inner = backend._rope_cache_attention

    def timed(*a: Any) -> Any:
        t = time.perf_counter()
        r = inner(*a)
        attn_s[0] += time.perf_counter() - t
        return r

    backend._rope_cache_attention = timed
    ids = torch.randint(100, cfg.vocab_size, (batch * chunk,), generator=g)
    pos = torch.arange(context, context + chunk).repeat(batch)
    last = torch.arange(chunk - 1, batch * chunk, chunk)

    def step() -> None:
        md = backend.build_metadata([chunk] * batch, [context + chunk] * batch, tables, block_size)
        with torch.inference_mode():
            model.compute_logits(model(ids, pos, kv, md)[last])

    try:
        step()
        steps, attns = [], []
        for _ in range(num_iters):
            attn_s[0] = 0.0
            t = time.perf_counter()
            step()
            steps.append(time.perf_counter() - t)
            attns.append(attn_s[0])
    finally:
        backend._rope_cache_attention = inner
    amx = bool(kernels.amx_attention_on())  # off under set_amx_attention(False) / TINYVLLM_AMX_ATTENTION=0
    dpbf16 = max(kernels.bf16_dot_ceiling(20000) for _ in range(3))
    amx_ceiling = max(kernels.amx_dot_ceiling(5000) for _ in range(3)) if amx else 0.0
    ceiling = amx_ceiling if amx else dpbf16
    flops = attention_flops(context, chunk, batch, cfg.num_attention_heads, cfg.head_dim, cfg.num_hidden_layers)
    nbytes = kv_bytes(context, chunk, batch, cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers)
    if kind != "bfloat16":  # one byte per value + the 2-byte scale per (token, head) row
        nbytes = nbytes * (cfg.head_dim + kv_quant.SCALE_BYTES) // (2 * cfg.head_dim)
    attn = statistics.median(attns)
    vnni = max(kernels.int8_dot_ceiling(20000) for _ in range(3)) if hasattr(kernels, "int8_dot_ceiling") else 0.0
    amx8 = (max(kernels.amx_int8_dot_ceiling(5000) for _ in range(3))
            if hasattr(kernels, "amx_int8_dot_ceiling") else 0.0)
    return {
        "kv_cache_dtype": kind, "vnni_ceiling_gflops": vnni / 1e9, "amx_int8_ceiling_gflops": amx8 / 1e9,
        "context": context, "chunk": chunk, "batch": batch, "block_size": block_size,
        "threads": torch.get_num_threads(), "num_iters": num_iters,
        "step_s": statistics.median(steps), "step_min_s": min(steps), "attention_s": attn,
        "attention_flop": flops, "attention_gflops": flops / attn / 1e9,
        "kernel": "amx" if amx else ("avx512-bf16" if dpbf16 else "row"),
        "ceiling_gflops": ceiling / 1e9, "dpbf16_ceiling_gflops": dpbf16 / 1e9, "amx_ceiling_gflops": amx_ceiling / 1e9,
        "attention_fraction_of_ceiling": (flops / attn) / ceiling if ceiling else float("nan"),
        "kv_bytes": nbytes, "kv_gb_per_s": nbytes / attn / 1e9,
    }


def main_prefill(args: argparse.Namespace) -> dict[str, Any]:
    """``bench prefill``: load the model in bf16 on the C++ backend, run :func:`run_prefill`, print a table."""
    import torch

    from tinyvllm.attention.selector import get_attn_backend
    from tinyvllm.kernels.cpu import cpu_kernels
    from tinyvllm.model.loader import resolve_model
    from tinyvllm.model.weights import load_model

    if args.threads:
        torch.set_num_threads(args.threads)
    kernels = cpu_kernels()
    if kernels is None:
        raise SystemExit("bench prefill needs the C++ CPU kernels (they could not be built)")
    model = load_model(resolve_model(args.model).model_dir, torch.bfloat16)
    backend = get_attn_backend("cpu", torch.bfloat16)
    model.bind_attn_backend(backend)
    res = run_prefill(model, backend, kernels, args.context, args.chunk, args.batch, args.block_size, args.num_iters,
                      kv_cache_dtype=args.kv_cache_dtype)
    res["model"] = args.model
    print(f"{'kernel':>11} {'KV':>8} {'batch':>5} {'context':>7} {'chunk':>5} {'thr':>3} {'step ms':>8} {'attn ms':>8} "
          f"{'attn GFLOP/s':>12} {'ceiling':>8} {'% ceil':>6} {'KV GB/s':>8} {'int8 VNNI':>9} {'AMX int8':>8}")
    print(f"{res['kernel']:>11} {res['kv_cache_dtype']:>8} {res['batch']:>5} {res['context']:>7} {res['chunk']:>5} "
          f"{res['threads']:>3} {res['step_s'] * 1e3:>8.1f} "
          f"{res['attention_s'] * 1e3:>8.1f} {res['attention_gflops']:>12.1f} {res['ceiling_gflops']:>8.1f} "
          f"{100 * res['attention_fraction_of_ceiling']:>6.1f} {res['kv_gb_per_s']:>8.2f} "
          f"{res['vnni_ceiling_gflops']:>9.1f} {res['amx_int8_ceiling_gflops']:>8.1f}")
    print("(ceilings in GFLOP/s of the kernels' dot-product loops, measured now: 'ceiling' the bf16 one the "
          "attention runs on; int8 VNNI / AMX int8: what an int8 Q K^T could reach)")
    if args.result_file:
        Path(args.result_file).write_text(json.dumps(res, indent=2))
    return res
