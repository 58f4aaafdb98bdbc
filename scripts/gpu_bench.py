#!/usr/bin/env python3
"""Time tinyvllm's Triton kernels on a CUDA GPU and print one table.

Run by ``scripts/gpu_check.sh`` after the kernel tests; not part of CI.

Rows, one table:
  * the device's ceilings, measured here: memory bandwidth (a device-to-device
    copy, bytes read + written) and bf16 matmul throughput (8192^3 product);
  * the whole tinyvllm engine (scheduler, model runner, sampler; ``LLM`` offline)
    on a Llama-3.2-1B-shaped model with random weights (``--load-format dummy``,
    :data:`tinyvllm.model.dummy.LLAMA_3_2_1B`, bf16, no download): prefill
    tokens/s, and decode tokens/s at batch 1/32/256 with CUDA graphs and eagerly,
    each next to its roofline time: max(bytes moved / measured bandwidth, FLOPs /
    measured matmul rate), where a decode step moves every weight once plus each
    sequence's KV, and a prefill is FLOP-bound;
  * each Triton kernel at Llama-3.2-1B shapes (32 query heads, 8 KV heads,
    head_dim 64, bf16, block_size 16) next to the PyTorch op a reader would
    otherwise use (SDPA / FlashAttention on contiguous K/V, eager RMSNorm/RoPE,
    index copy), with the max abs difference between the two;
  * the two attention kernels over an int8 and an fp8 KV cache
    (``--kv-cache-dtype``, :mod:`tinyvllm.attention.kv_quant`'s rows of
    head_dim values + a bf16 scale) at the chunk and decode shapes, next to the
    same kernel over the model-dtype cache (``ref ms``), with the max abs difference
    from float32 SDPA over the dequantized K/V;
  * with ``--stack``: a stack of the kernels and torch matmuls alone (no
    scheduler), a decode step eager and as one CUDA graph.

``--smoke`` runs tiny shapes on the CPU (kernels under the Triton interpreter,
the engine on its CPU path) to check the script itself without a GPU; its
timings mean nothing.  ``--json PATH`` also writes the rows as JSON.
Budget: about 3 minutes on an H100/H200 including Triton compilation and the
CUDA-graph capture.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
import traceback

SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402

from tinyvllm.attention import kv_quant  # noqa: E402
from tinyvllm.kernels.triton import attention as tk  # noqa: E402
from tinyvllm.kernels.triton import ops as tops  # noqa: E402

ROWS: list[tuple[str, str, str, str, str, str, str]] = []
RECORDS: list[dict] = []


def add_row(name, shape, t_ms, ref_ms=None, metric="", err=None, vs_ceiling=""):
    ROWS.append(
        (
            name,
            shape,
            f"{t_ms:.3f}",
            "-" if ref_ms is None else f"{ref_ms:.3f}",
            metric,
            vs_ceiling,
            "-" if err is None else f"{err:.1e}",
        )
    )
    RECORDS.append(dict(case=name, shape=shape, ms=t_ms, ref_ms=ref_ms, throughput=metric, vs_ceiling=vs_ceiling,
                        max_abs_diff=err))
    print(f"  done: {name} [{shape}] {t_ms:.3f} ms", flush=True)


def add_section(title):
    ROWS.append((f"-- {title}", "", "", "", "", "", ""))
    print(f"== {title}", flush=True)


def print_table():
    head = ("case", "shape", "ms", "ref ms", "throughput", "of ceiling", "max|diff|")
    widths = [max(len(r[i]) for r in ROWS + [head]) for i in range(len(head))]
    line = "+".join("-" * (w + 2) for w in widths)
    fmt = lambda r: "|".join(f" {c:<{w}} " for c, w in zip(r, widths))  # noqa: E731
    print(line)
    print(fmt(head))
    print(line)
    for r in ROWS:
        print(fmt(r))
    print(line)
    print("ref ms: the roofline time for ceiling and engine rows (max(bytes / bandwidth, FLOPs / matmul rate)),\n"
          "        the PyTorch op for kernel rows.  of ceiling: roofline / measured time, or achieved / peak rate.")


def timeit(fn, iters: int) -> float:
    """Mean milliseconds per call after warm-up."""
    for _ in range(2):
        fn()
    if DEV.type == "cuda":
        torch.cuda.synchronize()
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / iters
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t) * 1e3 / iters


def maxdiff(a, b) -> float:
    return float((a.float() - b.float()).abs().max())


def pct(achieved: float, ceiling: float) -> str:
    return f"{100 * achieved / ceiling:.0f}%" if ceiling > 0 and achieved == achieved else "-"  # NaN: not measured


# ---------------------------------------------------------------------------
# the device's ceilings
# ---------------------------------------------------------------------------


def measure_ceilings(cfg) -> dict:
    """Measured memory bandwidth (bytes/s, read + written by a device copy) and bf16 matmul rate (FLOP/s)."""
    add_section("device ceilings (measured)")
    n = cfg["copy_bytes"] // 2
    a = torch.ones(n, dtype=torch.bfloat16, device=DEV)
    b = torch.empty_like(a)
    t = timeit(lambda: b.copy_(a), cfg["iters"])
    bw = 2 * n * 2 / (t * 1e-3)
    add_row("ceiling: memory copy (read + write)", f"{2 * n / 2**30:.1f} GiB", t, None, f"{bw / 1e9:,.0f} GB/s")
    del a, b
    m = cfg["mm_size"]
    g = torch.Generator().manual_seed(3)
    x = torch.randn(m, m, generator=g).to(torch.bfloat16).to(DEV)
    y = torch.randn(m, m, generator=g).to(torch.bfloat16).to(DEV)
    t = timeit(lambda: x @ y, cfg["iters"])
    flops = 2 * m**3 / (t * 1e-3)
    add_row("ceiling: bf16 matmul", f"{m}x{m}x{m}", t, None, f"{flops / 1e12:,.1f} TFLOP/s")
    return {"bw": bw, "flops": flops}


# ---------------------------------------------------------------------------
# the whole engine on a Llama-3.2-1B-shaped model (random weights)
# ---------------------------------------------------------------------------


def bench_engine(cfg, ceil):
    try:
        from tinyvllm import LLM
        from tinyvllm.benchmarks.roofline import model_costs
        from tinyvllm.benchmarks.throughput import run_latency
        from tinyvllm.model.dummy import write_dummy_model_dir
    except ImportError as e:
        ROWS.append(("engine rows NOT RUN", f"missing package: {e.name}", "-", "-", "carry wheels (gpu_check.sh)",
                     "-", "-"))
        return
    mc = cfg["model"]
    elem = torch.empty(0, dtype=cfg["dtype"]).element_size()
    cost = model_costs(mc, elem)
    tag = f"{cost['params'] / 1e9:.2f}B params"
    add_section(f"engine, Llama-3.2-1B shape ({tag})" if DEV.type == "cuda" else "engine, tiny model, CPU")
    bw, peak = ceil["bw"], ceil["flops"]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_dummy_model_dir(tmp, mc)
        t0 = time.perf_counter()
        llm = LLM(str(model_dir), load_format="dummy", device=str(DEV), dtype=str(cfg["dtype"]).replace("torch.", ""),
                  **cfg["engine"])
        start_s = time.perf_counter() - t0
        runner = llm.llm_engine.core.runner
        graphs = runner.graph_runner
        print(f"  engine up in {start_s:.1f} s (weights, KV cache"
              f"{', CUDA-graph capture of sizes ' + str(graphs.sizes) if graphs else ''})", flush=True)
        run_latency(llm, 16, 4, 1, 1, seed=777)  # warm-up: first kernels compiled outside the timings

        B, L = cfg["engine_prefill"]
        r = run_latency(llm, L, 1, B, num_iters=2, seed=1)
        flops = B * L * cost["linear_flops_per_token"] + B * cost["head_flops_per_row"] \
            + B * cost["attn_flops_per_pair"] * L * (L + 1) / 2
        roof = max(flops / peak, cost["weight_bytes"] / bw)
        add_row("engine prefill", f"{B} prompts x {L} tok, budget {cfg['engine']['max_num_batched_tokens']}",
                r["prefill_s"] * 1e3, roof * 1e3, f"{r['prefill_tokens_per_s']:,.0f} tok/s",
                vs_ceiling=pct(roof, r["prefill_s"]))

        L, out = cfg["engine_decode_ctx"]
        ctx = L + out / 2  # mean context over the measured decode steps
        for mode in (["graph", "eager"] if graphs is not None else ["eager"]):
            runner.graph_runner = graphs if mode == "graph" else None
            for B in cfg["engine_decode_batches"]:
                # Timed: the steps in which all B sequences decode (run_latency); prefix caching is off, so
                # the eager pass computes the same prompts again instead of hitting the graph pass's blocks.
                r = run_latency(llm, L, out, B, num_iters=2, seed=10 + B)
                nb = r["decode_batch"]
                nbytes = cost["weight_bytes"] + nb * ctx * cost["kv_bytes_per_token"]
                flops = nb * (cost["linear_flops_per_token"] + cost["head_flops_per_row"]
                              + cost["attn_flops_per_pair"] * ctx)
                roof = max(nbytes / bw, flops / peak)
                step = r["decode_step_s"]
                shape = f"B={B} ctx {L}+{out}" + ("" if nb == B else f" (mean batch {nb:.1f})")
                add_row(f"engine decode ({'CUDA graphs' if mode == 'graph' else 'eager'})",
                        shape, step * 1e3, roof * 1e3, f"{r['decode_tokens_per_s']:,.0f} tok/s",
                        vs_ceiling=pct(roof, step))
        runner.graph_runner = graphs
        del llm


# ---------------------------------------------------------------------------
# paged-cache helpers
# ---------------------------------------------------------------------------


def make_tables(seq_lens, block_size, num_blocks, gen):
    """Shuffled block tables for the given lengths; returns (tables, slot_fn)."""
    need = [triton.cdiv(s, block_size) for s in seq_lens]
    assert sum(need) <= num_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    i = 0
    for s, n in enumerate(need):
        tables[s, :n] = perm[i : i + n].to(torch.int32)
        i += n
    return tables


def slots_for(tables, starts, ends, block_size):
    out = []
    for s, (a, b) in enumerate(zip(starts, ends)):
        pos = torch.arange(a, b)
        out.append(tables[s, pos // block_size].long() * block_size + pos % block_size)
    return torch.cat(out)


# ---------------------------------------------------------------------------
# kernel rows
# ---------------------------------------------------------------------------


def quantized_cache(k, v, kind, num_blocks, block_size, slots, dt):
    """``k``/``v`` rows [T, Hk, D] stored in a fresh int8/fp8 paged cache (``kv_quant.quantize``,
    ``reshape_and_cache``), and their dequantized float32 rows (exact: the reference attends over them)."""
    qk, qv = kv_quant.quantize(k, kind, dt), kv_quant.quantize(v, kind, dt)
    cache = torch.zeros(2, num_blocks, block_size, *qk.shape[1:], dtype=qk.dtype, device=DEV)
    tk.reshape_and_cache(qk, qv, cache[0], cache[1], slots)
    return cache, kv_quant.dequantize(qk), kv_quant.dequantize(qv)


def bench_kernels(cfg, ceil):
    add_section("Triton kernels vs PyTorch op")
    H, KVH, D, BS = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["block_size"]
    dt, it = cfg["dtype"], cfg["iters"]
    gen = torch.Generator().manual_seed(0)
    scale = D**-0.5

    # ---- prefill: B fresh prompts of length L (causal) ----
    B, L = cfg["prefill_batch"], cfg["prefill_len"]
    num_blocks = B * triton.cdiv(L, BS) + 8
    kv = torch.empty(2, num_blocks, BS, KVH, D, dtype=dt, device=DEV)
    tables = make_tables([L] * B, BS, num_blocks, gen)
    slots = slots_for(tables, [0] * B, [L] * B, BS).to(DEV)
    q = torch.randn(B * L, H, D, generator=gen).to(dt).to(DEV)
    k = torch.randn(B * L, KVH, D, generator=gen).to(dt).to(DEV)
    v = torch.randn(B * L, KVH, D, generator=gen).to(dt).to(DEV)
    bt, sl = tables.to(DEV), torch.full((B,), L, dtype=torch.int32, device=DEV)
    qsl = torch.arange(0, B * L + 1, L, dtype=torch.int32, device=DEV)

    t = timeit(lambda: tk.reshape_and_cache(k, v, kv[0], kv[1], slots), it)
    flat = kv.view(2, -1, KVH, D)
    ref_t = timeit(lambda: (flat[0].index_copy_(0, slots, k), flat[1].index_copy_(0, slots, v)), it)
    gbs = 4 * k.numel() * k.element_size() / (t * 1e-3) / 1e9
    add_row("reshape_and_cache", f"T={B * L} kvh={KVH} d={D}", t, ref_t, f"{gbs:.0f} GB/s", 0.0, pct(gbs * 1e9, ceil["bw"]))

    tk.reshape_and_cache(k, v, kv[0], kv[1], slots)
    out = tk.paged_prefill_attention(q, kv[0], kv[1], bt, sl, qsl, scale)
    qs = q.view(B, L, H, D).transpose(1, 2)
    ks = k.view(B, L, KVH, D).transpose(1, 2)
    vs = v.view(B, L, KVH, D).transpose(1, 2)

    def sdpa_prefill():
        return F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)

    ref = sdpa_prefill().transpose(1, 2).reshape(B * L, H, D)
    err = maxdiff(out, ref)
    t = timeit(lambda: tk.paged_prefill_attention(q, kv[0], kv[1], bt, sl, qsl, scale, out=out), it)
    ref_t = timeit(sdpa_prefill, it)
    flops = 4 * B * H * D * L * L / 2  # causal half
    add_row("prefill attn (fresh, causal)", f"B={B} L={L}", t, ref_t, f"{flops / (t * 1e-3) / 1e12:.1f} TFLOP/s", err,
            pct(flops / (t * 1e-3), ceil["flops"]))

    # ---- chunked prefill: a chunk after a long cached prefix ----
    P, C = cfg["chunk_prefix"], cfg["chunk_len"]
    nb = triton.cdiv(P + C, BS) + 8
    kv2 = torch.empty(2, nb, BS, KVH, D, dtype=dt, device=DEV)
    tables2 = make_tables([P + C], BS, nb, gen)
    kk = torch.randn(P + C, KVH, D, generator=gen).to(dt).to(DEV)
    vv = torch.randn(P + C, KVH, D, generator=gen).to(dt).to(DEV)
    slots2 = slots_for(tables2, [0], [P + C], BS).to(DEV)
    tk.reshape_and_cache(kk, vv, kv2[0], kv2[1], slots2)
    q2 = torch.randn(C, H, D, generator=gen).to(dt).to(DEV)
    bt2, sl2 = tables2.to(DEV), torch.tensor([P + C], dtype=torch.int32, device=DEV)
    qsl2 = torch.tensor([0, C], dtype=torch.int32, device=DEV)
    out2 = tk.paged_prefill_attention(q2, kv2[0], kv2[1], bt2, sl2, qsl2, scale)
    mask = torch.arange(P + C, device=DEV)[None, :] <= (P + torch.arange(C, device=DEV))[:, None]

    def sdpa_chunk():
        return F.scaled_dot_product_attention(
            q2.transpose(0, 1)[None], kk.transpose(0, 1)[None], vv.transpose(0, 1)[None],
            attn_mask=mask, scale=scale, enable_gqa=True,
        )

    err = maxdiff(out2, sdpa_chunk()[0].transpose(0, 1))
    t = timeit(lambda: tk.paged_prefill_attention(q2, kv2[0], kv2[1], bt2, sl2, qsl2, scale, out=out2), it)
    ref_t = timeit(sdpa_chunk, it)
    flops = 4 * H * D * C * (P + C / 2)
    add_row("prefill attn (chunk after prefix)", f"prefix={P} chunk={C}", t, ref_t,
            f"{flops / (t * 1e-3) / 1e12:.1f} TFLOP/s", err, pct(flops / (t * 1e-3), ceil["flops"]))

    # ---- the same chunk over an int8 / fp8 cache (the same K/V, quantized per row) ----
    for kind in kv_quant.QUANTIZED:
        qkv2, dk, dv = quantized_cache(kk, vv, kind, nb, BS, slots2, dt)  # the reference in float32
        qref = F.scaled_dot_product_attention(q2.float().transpose(0, 1)[None], dk.transpose(0, 1)[None],
                                              dv.transpose(0, 1)[None], attn_mask=mask, scale=scale,
                                              enable_gqa=True)[0].transpose(0, 1)
        oq = tk.paged_prefill_attention(q2, qkv2[0], qkv2[1], bt2, sl2, qsl2, scale)
        err = maxdiff(oq, qref)
        t = timeit(lambda: tk.paged_prefill_attention(q2, qkv2[0], qkv2[1], bt2, sl2, qsl2, scale, out=oq), it)
        ref_t = timeit(lambda: tk.paged_prefill_attention(q2, kv2[0], kv2[1], bt2, sl2, qsl2, scale, out=out2), it)
        add_row(f"prefill attn (chunk, {kind} KV; ref ms: {str(dt)[6:]} KV)", f"prefix={P} chunk={C}", t, ref_t,
                f"{flops / (t * 1e-3) / 1e12:.1f} TFLOP/s", err, pct(flops / (t * 1e-3), ceil["flops"]))

    # ---- decode: B sequences of context N ----
    for B, N in cfg["decode_cases"]:
        nb = B * triton.cdiv(N, BS) + 8
        kv3 = torch.empty(2, nb, BS, KVH, D, dtype=dt, device=DEV)
        tables3 = make_tables([N] * B, BS, nb, gen)
        kk = torch.randn(B * N, KVH, D, generator=gen).to(dt).to(DEV)
        vv = torch.randn(B * N, KVH, D, generator=gen).to(dt).to(DEV)
        slots3 = slots_for(tables3, [0] * B, [N] * B, BS).to(DEV)
        tk.reshape_and_cache(kk, vv, kv3[0], kv3[1], slots3)
        q3 = torch.randn(B, H, D, generator=gen).to(dt).to(DEV)
        bt3, sl3 = tables3.to(DEV), torch.full((B,), N, dtype=torch.int32, device=DEV)
        ks = kk.view(B, N, KVH, D).transpose(1, 2)
        vs = vv.view(B, N, KVH, D).transpose(1, 2)

        def sdpa_decode():
            return F.scaled_dot_product_attention(q3[:, :, None], ks, vs, scale=scale, enable_gqa=True)

        ref = sdpa_decode()[:, :, 0]
        ref_t = timeit(sdpa_decode, it)
        kv_bytes = 2 * B * N * KVH * D * kk.element_size()
        for splits in (1, None):
            o = tk.paged_decode_attention(q3, kv3[0], kv3[1], bt3, sl3, scale, num_splits=splits)
            err = maxdiff(o, ref)
            t = timeit(lambda: tk.paged_decode_attention(q3, kv3[0], kv3[1], bt3, sl3, scale, num_splits=splits, out=o), it)
            used = splits or tk.default_num_splits(B, KVH, bt3.shape[1] * BS, DEV)
            add_row(f"decode attn (splits={used}{'' if splits else ', auto'})", f"B={B} ctx={N}", t, ref_t,
                    f"{kv_bytes / (t * 1e-3) / 1e9:.0f} GB/s KV", err, pct(kv_bytes / (t * 1e-3), ceil["bw"]))
            if splits is None:  # the auto split over an int8 / fp8 cache: half the bytes (+ the scales)
                bf16_t = t
                for kind in kv_quant.QUANTIZED:
                    qkv3, dk, dv = quantized_cache(kk, vv, kind, nb, BS, slots3, dt)  # float32 reference
                    dk, dv = (x.view(B, N, KVH, D).transpose(1, 2) for x in (dk, dv))
                    qref = F.scaled_dot_product_attention(q3.float()[:, :, None], dk, dv, scale=scale,
                                                          enable_gqa=True)[:, :, 0]
                    oq = tk.paged_decode_attention(q3, qkv3[0], qkv3[1], bt3, sl3, scale)
                    err = maxdiff(oq, qref)
                    t = timeit(lambda: tk.paged_decode_attention(q3, qkv3[0], qkv3[1], bt3, sl3, scale, out=oq), it)
                    q_bytes = 2 * B * N * KVH * (D + kv_quant.SCALE_BYTES)
                    add_row(f"decode attn (auto, {kind} KV; ref ms: {str(dt)[6:]} KV)", f"B={B} ctx={N}", t, bf16_t,
                            f"{q_bytes / (t * 1e-3) / 1e9:.0f} GB/s KV", err, pct(q_bytes / (t * 1e-3), ceil["bw"]))

    # ---- fused RMSNorm + residual, RoPE ----
    T, Hd = cfg["norm_tokens"], cfg["hidden"]
    x = torch.randn(T, Hd, generator=gen).to(dt).to(DEV)
    r = torch.randn(T, Hd, generator=gen).to(dt).to(DEV)
    w = (1 + 0.1 * torch.randn(Hd, generator=gen)).to(dt).to(DEV)

    def torch_norm():
        s = x + r
        h = s.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
        return w * h.to(dt), s

    err = maxdiff(tops.rms_norm(x, w, 1e-5, residual=r)[0], torch_norm()[0])
    t = timeit(lambda: tops.rms_norm(x, w, 1e-5, residual=r), it)
    ref_t = timeit(torch_norm, it)
    add_row("rms_norm + residual", f"T={T} hidden={Hd}", t, ref_t,
            f"{5 * x.numel() * x.element_size() / (t * 1e-3) / 1e9:.0f} GB/s", err)

    inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
    fr = torch.outer(torch.arange(8192, dtype=torch.float32), inv)
    cs = torch.cat([fr.cos(), fr.sin()], -1).to(DEV)
    pos = torch.randint(0, 8192, (T,), generator=gen).to(DEV)
    qr = torch.randn(T, H, D, generator=gen).to(dt).to(DEV)
    kr = torch.randn(T, KVH, D, generator=gen).to(dt).to(DEV)

    def torch_rope(x):
        c, s = cs[pos][:, None, : D // 2].to(dt), cs[pos][:, None, D // 2 :].to(dt)
        c, s = torch.cat([c, c], -1), torch.cat([s, s], -1)
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return x * c + torch.cat([-x2, x1], -1) * s

    qc, kc = qr.clone(), kr.clone()
    tops.rotary_embedding(pos, qc, kc, cs)
    err = max(maxdiff(qc, torch_rope(qr)), maxdiff(kc, torch_rope(kr)))
    t = timeit(lambda: tops.rotary_embedding(pos, qc, kc, cs), it)
    ref_t = timeit(lambda: (torch_rope(qr), torch_rope(kr)), it)
    add_row("rotary_embedding (q+k, in place)", f"T={T} h={H}+{KVH}", t, ref_t, "", err)


# ---------------------------------------------------------------------------
# Llama-3.2-1B-shaped stack (random weights)
# ---------------------------------------------------------------------------


class Stack:
    def __init__(self, cfg, max_tokens_cached):
        self.cfg = cfg
        H, KVH, D, Hd, I = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["hidden"], cfg["intermediate"]
        dt = cfg["dtype"]
        g = torch.Generator().manual_seed(1)

        def w(*shape):
            return (0.02 * torch.randn(*shape, generator=g)).to(dt).to(DEV)

        self.layers = []
        for _ in range(cfg["layers"]):
            self.layers.append(
                dict(
                    ln1=(1 + 0.1 * torch.randn(Hd, generator=g)).to(dt).to(DEV),
                    qkv=w((H + 2 * KVH) * D, Hd),
                    o=w(Hd, H * D),
                    ln2=(1 + 0.1 * torch.randn(Hd, generator=g)).to(dt).to(DEV),
                    gate_up=w(2 * I, Hd),
                    down=w(Hd, I),
                )
            )
        self.final_ln = torch.ones(Hd, dtype=dt, device=DEV)
        BS = cfg["block_size"]
        self.num_blocks = triton.cdiv(max_tokens_cached, BS) + 16
        self.kv = [torch.empty(2, self.num_blocks, BS, KVH, D, dtype=dt, device=DEV) for _ in range(cfg["layers"])]
        inv = 1.0 / (500000.0 ** (torch.arange(0, D, 2, dtype=torch.float32) / D))
        fr = torch.outer(torch.arange(cfg["max_pos"], dtype=torch.float32), inv)
        self.cos_sin = torch.cat([fr.cos(), fr.sin()], -1).to(DEV)
        self.scale = D**-0.5

    def forward(self, x, positions, slot_mapping, block_tables, seq_lens, query_start_loc, decode: bool):
        cfg = self.cfg
        H, KVH, D, I = cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["intermediate"]
        T = x.shape[0]
        residual = None
        for layer, kv in zip(self.layers, self.kv):
            h, residual = tops.rms_norm(x, layer["ln1"], 1e-5, residual)
            qkv = F.linear(h, layer["qkv"]).view(T, H + 2 * KVH, D)
            q, k, v = qkv[:, :H], qkv[:, H : H + KVH], qkv[:, H + KVH :]
            tops.rotary_embedding(positions, q, k, self.cos_sin)
            tk.reshape_and_cache(k, v, kv[0], kv[1], slot_mapping)
            if decode:
                a = tk.paged_decode_attention(q, kv[0], kv[1], block_tables, seq_lens, self.scale)
            else:
                a = tk.paged_prefill_attention(q, kv[0], kv[1], block_tables, seq_lens, query_start_loc, self.scale)
            x = F.linear(a.view(T, H * D), layer["o"])
            h, residual = tops.rms_norm(x, layer["ln2"], 1e-5, residual)
            gu = F.linear(h, layer["gate_up"])
            x = F.linear(F.silu(gu[:, :I]) * gu[:, I:], layer["down"])
        out, _ = tops.rms_norm(x, self.final_ln, 1e-5, residual)
        return out


def bench_stack(cfg, ceil=None):
    add_section("kernel stack, no scheduler")
    BS, Hd = cfg["block_size"], cfg["hidden"]
    dt, it = cfg["dtype"], max(3, cfg["iters"] // 4)
    gen = torch.Generator().manual_seed(2)
    PB, PL = cfg["stack_prefill_batch"], cfg["stack_prefill_len"]
    DB, DN = cfg["stack_decode_batch"], cfg["stack_decode_ctx"]
    stack = Stack(cfg, max(PB * PL, DB * DN))
    tag = f"{cfg['layers']}L h{Hd} {cfg['heads']}/{cfg['kv_heads']}x{cfg['head_dim']} ffn{cfg['intermediate']}"
    flops_per_tok = 2 * sum(p.numel() for L in stack.layers for n, p in L.items() if p.dim() == 2)

    # prefill step: PB prompts of PL tokens
    tables = make_tables([PL] * PB, BS, stack.num_blocks, gen)
    args = dict(
        positions=torch.arange(PL).repeat(PB).to(DEV),
        slot_mapping=slots_for(tables, [0] * PB, [PL] * PB, BS).to(DEV),
        block_tables=tables.to(DEV),
        seq_lens=torch.full((PB,), PL, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(0, PB * PL + 1, PL, dtype=torch.int32, device=DEV),
    )
    x = (0.5 * torch.randn(PB * PL, Hd, generator=gen)).to(dt).to(DEV)
    out = stack.forward(x, decode=False, **args)
    assert torch.isfinite(out.float()).all(), "prefill stack produced NaN/inf"
    t = timeit(lambda: stack.forward(x, decode=False, **args), it)
    toks = PB * PL
    add_row("stack prefill step", f"{tag}; {PB}x{PL} tok", t, None,
            f"{toks / (t * 1e-3):,.0f} tok/s, {toks * flops_per_tok / (t * 1e-3) / 1e12:.0f} TFLOP/s")

    # decode step: DB sequences at context DN (their earlier KV is garbage-free random: written by a prefill)
    tables = make_tables([DN] * DB, BS, stack.num_blocks, gen)
    pre = dict(
        positions=torch.arange(DN).repeat(DB).to(DEV),
        slot_mapping=slots_for(tables, [0] * DB, [DN] * DB, BS).to(DEV),
        block_tables=tables.to(DEV),
        seq_lens=torch.full((DB,), DN, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(0, DB * DN + 1, DN, dtype=torch.int32, device=DEV),
    )
    stack.forward((0.5 * torch.randn(DB * DN, Hd, generator=gen)).to(dt).to(DEV), decode=False, **pre)
    dec = dict(
        positions=torch.full((DB,), DN - 1, dtype=torch.int64, device=DEV),
        slot_mapping=slots_for(tables, [DN - 1] * DB, [DN] * DB, BS).to(DEV),
        block_tables=tables.to(DEV),
        seq_lens=torch.full((DB,), DN, dtype=torch.int32, device=DEV),
        query_start_loc=torch.arange(DB + 1, dtype=torch.int32, device=DEV),
    )
    xd = (0.5 * torch.randn(DB, Hd, generator=gen)).to(dt).to(DEV)
    eager_out = stack.forward(xd, decode=True, **dec)
    assert torch.isfinite(eager_out.float()).all(), "decode stack produced NaN/inf"
    # same token through the prefill kernel must agree (re-writing the same KV is idempotent)
    pf_out = stack.forward(xd, decode=False, **dec)
    err = maxdiff(eager_out, pf_out)
    t = timeit(lambda: stack.forward(xd, decode=True, **dec), it)
    add_row("stack decode step (eager)", f"{tag}; B={DB} ctx={DN}", t, None, f"{DB / (t * 1e-3):,.0f} tok/s", err)

    if DEV.type == "cuda":
        try:
            static_x = xd.clone()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(2):
                    stack.forward(static_x, decode=True, **dec)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = stack.forward(static_x, decode=True, **dec)
            graph.replay()
            torch.cuda.synchronize()
            err = maxdiff(static_out, eager_out)
            t = timeit(graph.replay, it * 4)
            add_row("stack decode step (CUDA graph)", f"{tag}; B={DB} ctx={DN}", t, None,
                    f"{DB / (t * 1e-3):,.0f} tok/s", err)
        except Exception as e:  # report, do not hide the rest of the table
            ROWS.append(("stack decode step (CUDA graph)", "FAILED", "-", "-", f"{type(e).__name__}: {e}"[:80], "-",
                         "-"))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on CPU (Triton interpreter), checks the script")
    ap.add_argument("--skip-kernels", action="store_true", help="no per-kernel rows")
    ap.add_argument("--skip-engine", action="store_true", help="no engine rows")
    ap.add_argument("--stack", action="store_true", help="also time the kernel stack without the scheduler")
    ap.add_argument("--json", default=None, help="also write the rows here as JSON")
    a = ap.parse_args()
    global DEV
    from tinyvllm.model.dummy import LLAMA_3_2_1B

    if a.smoke:
        DEV = torch.device("cpu")
        model = dict(LLAMA_3_2_1B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                     rope_scaling=dict(LLAMA_3_2_1B["rope_scaling"], original_max_position_embeddings=64))
        cfg = dict(heads=4, kv_heads=2, head_dim=16, block_size=16, dtype=torch.float32, iters=1,
                   copy_bytes=64 << 20, mm_size=256,
                   prefill_batch=2, prefill_len=20, chunk_prefix=30, chunk_len=9,
                   decode_cases=[(2, 40), (1, 600)], norm_tokens=8, hidden=32, intermediate=64, layers=2, max_pos=256,
                   stack_prefill_batch=2, stack_prefill_len=12, stack_decode_batch=2, stack_decode_ctx=20,
                   model=model, engine=dict(max_num_seqs=8, max_num_batched_tokens=64, kv_cache_memory="16MiB",
                                            max_model_len=256, enable_prefix_caching=False),
                   engine_prefill=(2, 48), engine_decode_ctx=(16, 6), engine_decode_batches=(1, 4, 8))
    else:
        if not torch.cuda.is_available():
            sys.exit("gpu_bench.py needs a CUDA GPU (or --smoke)")
        DEV = torch.device("cuda")
        cfg = dict(heads=32, kv_heads=8, head_dim=64, block_size=16, dtype=torch.bfloat16, iters=20,
                   copy_bytes=4 << 30, mm_size=8192,
                   prefill_batch=4, prefill_len=2048, chunk_prefix=8192, chunk_len=512,
                   decode_cases=[(1, 8192), (32, 2048), (128, 1024)],
                   norm_tokens=4096, hidden=2048, intermediate=8192, layers=16, max_pos=8192,
                   stack_prefill_batch=4, stack_prefill_len=1024, stack_decode_batch=64, stack_decode_ctx=1024,
                   model=dict(LLAMA_3_2_1B),
                   engine=dict(max_num_seqs=256, max_num_batched_tokens=8192, kv_cache_memory="32GiB",
                               max_model_len=4096, enable_prefix_caching=False),
                   engine_prefill=(16, 1024), engine_decode_ctx=(512, 64), engine_decode_batches=(1, 32, 256))
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    t0 = time.time()
    info = dict(device=torch.cuda.get_device_name() if DEV.type == "cuda" else "cpu", torch=torch.__version__,
                triton=triton.__version__, smoke=a.smoke)
    state = {"failed": 0}

    def report(final: bool, complete: bool = True) -> None:
        """The table and the JSON so far (after each section, and when killed by ``timeout``)."""
        info["total_s"] = time.time() - t0
        if a.json:
            with open(a.json, "w") as f:
                json.dump(dict(info=info, rows=RECORDS, failed_sections=state["failed"],
                               complete=final and complete), f, indent=2)
        if final:
            print()
            print_table()
            print(f"total {info['total_s']:.0f} s (includes Triton JIT compilation and CUDA-graph capture)")

    def on_sigterm(signum, frame):  # `timeout` in gpu_check.sh: keep what was measured
        print(f"\ngpu_bench.py: stopped by signal {signum}; the table so far:", flush=True)
        report(final=True, complete=False)
        sys.exit(124)

    signal.signal(signal.SIGTERM, on_sigterm)
    nan = float("nan")
    ceil = {"bw": nan, "flops": nan}

    def ceilings(cfg, _):
        ceil.update(measure_ceilings(cfg))
        info["ceilings"] = dict(ceil)

    sections = [(ceilings, True), (bench_engine, not a.skip_engine), (bench_kernels, not a.skip_kernels),
                (bench_stack, a.stack)]
    for fn, wanted in sections:
        if not wanted:
            continue
        try:  # one broken section must not cost the rest of the table on a short GPU lease
            fn(cfg, ceil)
        except Exception as e:
            state["failed"] += 1
            traceback.print_exc()
            ROWS.append((f"{fn.__name__} FAILED", "-", "-", "-", f"{type(e).__name__}: {e}"[:80], "-", "-"))
        report(final=False)
    report(final=True)
    if state["failed"]:
        sys.exit(f"gpu_bench.py: {state['failed']} section(s) failed (tracebacks above)")


DEV = torch.device("cpu")

if __name__ == "__main__":
    main()
