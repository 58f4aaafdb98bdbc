"""Dump the outputs of every C++ CPU kernel entry point on fixed random inputs, and compare two dumps
bit for bit: the evidence that a refactor of ``tinyvllm/kernels/cpu`` changed no bits (issue 42).

    # this checkout's kernels, native build (AVX-512 / AMX here) and the AVX2 build:
    python scripts/kernel_bits.py dump --isa native --out /tmp/after-native.pt
    python scripts/kernel_bits.py dump --isa avx2 --out /tmp/after-avx2.pt
    # another checkout's kernels (e.g. a worktree of the commit before), the same flags:
    python scripts/kernel_bits.py dump --src /work/base/tinyvllm/kernels/cpu --isa avx2 --out /tmp/before-avx2.pt
    python scripts/kernel_bits.py compare /tmp/before-avx2.pt /tmp/after-avx2.pt

``--isa`` is a key of :data:`tinyvllm.kernels.cpu.ISA_CFLAGS` (``avx2``: ``-march=haswell``, the AVX2
paths on an AVX-512 machine). Every case runs on every path the build has: the vector kernels and the
portable scalar loops (``set_vector_kernels``), the tiled and the row attention (``set_tiled_attention``),
AMX and VDPBF16PS (``set_amx_attention`` / ``set_amx_gemm``). ``compare`` exits 1 when a case differs
in any bit (NaNs compared as bit patterns) or is missing from one side, and prints each case's verdict.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _attention_inputs(seqs, hq, hk, d, bs, dtype, seed):
    """Ragged batch over a shuffled paged cache (NaN in unused slots): q, caches, block table, seq, pos."""
    g = _gen(seed)
    total = sum((c + n + bs - 1) // bs for c, n in seqs) + 2
    perm = torch.randperm(total, generator=g).tolist()
    kc = torch.full((total, bs, hk, d), float("nan")).to(dtype)
    vc = kc.clone()
    tables, qs, seq, pos = [], [], [], []
    for i, (c, n) in enumerate(seqs):
        L = c + n
        blocks = [perm.pop() for _ in range((L + bs - 1) // bs)]
        tables.append(blocks)
        k = torch.randn(L, hk, d, generator=g).to(dtype)
        v = torch.randn(L, hk, d, generator=g).to(dtype)
        for j in range(L):
            kc[blocks[j // bs], j % bs] = k[j]
            vc[blocks[j // bs], j % bs] = v[j]
        qs.append(torch.randn(n, hq, d, generator=g).to(dtype).float())
        seq += [i] * n
        pos += list(range(c, L))
    bt = torch.zeros(len(seqs), max(len(t) for t in tables), dtype=torch.int64)
    for i, t in enumerate(tables):
        bt[i, : len(t)] = torch.tensor(t)
    return torch.cat(qs), kc, vc, bt, torch.tensor(seq), torch.tensor(pos)


SEQS = [(0, 1), (15, 1), (16, 1), (99, 1), (0, 9), (13, 20), (40, 3), (0, 17), (300, 40)]
HEADS = [(4, 4, 16), (4, 2, 32), (9, 3, 64), (6, 2, 96), (2, 1, 128), (6, 2, 24), (32, 2, 64)]


def _paths(kern):
    """(name, setter) for every attention path this build has."""
    out = [("scalar", dict(vector=False, tiled=True, amx=True)), ("row", dict(vector=True, tiled=False, amx=True))]
    if kern.has_tiled_attention():
        out.append(("tiled_vdpbf16ps", dict(vector=True, tiled=True, amx=False)))
    if kern.has_amx_attention():
        out.append(("tiled_amx", dict(vector=True, tiled=True, amx=True)))
    return out


def _set(kern, vector=True, tiled=True, amx=True):
    kern.set_vector_kernels(vector)
    kern.set_tiled_attention(tiled)
    kern.set_amx_attention(amx)


def dump_attention(kern, res):
    for name, p in _paths(kern):
        _set(kern, **p)
        for dtype in (torch.float32, torch.bfloat16):
            for hq, hk, d in HEADS:
                for bs in (4, 16):
                    args = _attention_inputs(SEQS, hq, hk, d, bs, dtype, seed=hq * 1000 + d + bs)
                    res[f"paged_attention/{name}/{str(dtype)[6:]}/{hq}x{hk}x{d}/bs{bs}"] = kern.paged_attention(
                        *args, d ** -0.5)
    _set(kern)


def dump_rope_cache_attention(kern, res):
    hq, hk, d, nb, bs = 4, 2, 64, 40, 16
    for name, p in _paths(kern):
        _set(kern, **p)
        for dtype in (torch.bfloat16, torch.float32):
            for cache in ("model", "int8", "fp8"):
                g = _gen(11)
                T, pos0 = 70, 90
                qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 2).to(dtype)
                pos = torch.arange(pos0, pos0 + T)
                inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
                ang = torch.arange(pos0 + T + 1).float()[:, None] * inv[None]
                blocks = torch.randperm(nb, generator=g)[: (pos0 + T + bs - 1) // bs]
                slots = blocks[pos // bs] * bs + pos % bs
                if cache == "model":
                    kv = torch.randn(2, nb, bs, hk, d, generator=g).to(dtype)
                else:
                    kv = torch.randint(-100, 100, (2, nb, bs, hk, d + 2), generator=g, dtype=torch.int8)
                    kv[..., d:] = 0
                    kv[..., d + 1] = 0x3C  # bf16 scale bits 0x3C00 = 2^-7 (little endian: byte d+1 is the high byte)
                    if cache == "fp8":
                        kv = (kv.to(torch.int16) & 0x77).to(torch.uint8)  # finite e4m3 bytes
                        kv[..., d] = 0
                        kv[..., d + 1] = 0x3C
                out = kern.rope_cache_attention(qkv, ang.cos(), ang.sin(), pos, kv, slots, blocks[None].long(),
                                                torch.zeros(T, dtype=torch.int64), hq, hk, d ** -0.5)
                res[f"rope_cache_attention/{name}/{str(dtype)[6:]}/{cache}"] = out
                res[f"rope_cache_attention/{name}/{str(dtype)[6:]}/{cache}/cache"] = kv
    _set(kern)


def dump_norm_act(kern, res):
    for vector in (True, False):
        kern.set_vector_kernels(vector)
        tag = "vector" if vector else "scalar"
        for dtype in (torch.float32, torch.bfloat16):
            for hidden in (64, 576, 1000):
                g = _gen(hidden)
                x = torch.randn(37, hidden, generator=g).to(dtype)
                r = torch.randn(37, hidden, generator=g).to(dtype)
                w = torch.randn(hidden, generator=g).to(dtype)
                res[f"rms_norm/{tag}/{str(dtype)[6:]}/{hidden}"] = torch.stack(list(kern.rms_norm(x, None, w, 1e-6)))
                res[f"rms_norm_residual/{tag}/{str(dtype)[6:]}/{hidden}"] = torch.stack(list(kern.rms_norm(x, r, w, 1e-6)))
                res[f"silu_and_mul/{tag}/{str(dtype)[6:]}/{hidden}"] = kern.silu_and_mul(
                    torch.randn(37, 2 * hidden, generator=g).mul(4).to(dtype))
    kern.set_vector_kernels(True)


def dump_gemm_bf16(kern, res):
    if not kern.gemm_has_bf16_kernel():
        return
    amx_paths = [False] + ([True] if kern.has_amx_gemm() else [])
    for amx in amx_paths:
        kern.set_amx_gemm(amx)
        for n, k in ((17, 7), (130, 1), (200, 333), (576, 576)):
            g = _gen(n * 7 + k)
            w = torch.randn(n, k, generator=g).to(torch.bfloat16)
            packed = kern.gemm_pack_bf16(w)
            bias = torch.randn(n, generator=g)
            for m in (1, 3, 16, 40, 300):
                x = torch.randn(m, k, generator=g).to(torch.bfloat16)
                for out_float in (False, True):
                    res[f"gemm_bf16/{'amx' if amx else 'vdpbf16ps'}/{n}x{k}/m{m}/f32{int(out_float)}"] = kern.gemm_bf16(
                        x, packed, n, k, bias, out_float)
    kern.set_amx_gemm(True)


def dump_gguf(kern, res):
    from tinyvllm.benchmarks.random_gguf import random_blocks
    from tinyvllm.model.gguf_quant import repack

    for qtype, n, k in (("Q8_0", 250, 160), ("Q4_0", 232, 160), ("Q4_1", 250, 160), ("Q4_K", 250, 512),
                        ("Q6_K", 232, 512)):
        raw = random_blocks(np.random.default_rng(5), n, k, qtype, k ** -0.5)
        w = repack(raw, qtype, n, k, "t")
        g = _gen(n + k)
        bias = torch.randn(n, generator=g)
        for m in (1, 2, 3, 9, 63, 300):
            x = torch.randn(m, k, generator=g)
            for xd in (torch.bfloat16, torch.float32):
                xx = x.to(xd)
                key = f"{qtype}/m{m}/{str(xd)[6:]}"
                res[f"gemm_gguf/{key}"] = kern.gemm_gguf(xx, w.qs, w.scales, w.fmt, n, k, bias)
                res[f"gemm_gguf_out_float/{key}"] = kern.gemm_gguf(xx, w.qs, w.scales, w.fmt, n, k, bias, True)
                res[f"gemm_gguf_ref/{key}"] = kern.gemm_gguf_ref(xx, w.qs, w.scales, w.fmt, n, k, bias)
                if qtype != "Q6_K":
                    res[f"gemm_gguf_q8/{key}"] = kern.gemm_gguf_q8(xx, w.qs, w.scales, w.fmt, n, k, bias)
                    res[f"gemm_gguf_q8_out_float/{key}"] = kern.gemm_gguf_q8(xx, w.qs, w.scales, w.fmt, n, k, bias, True)
                    res[f"gemm_gguf_q8_ref/{key}"] = kern.gemm_gguf_q8_ref(xx, w.qs, w.scales, w.fmt, n, k, bias)


def dump_bitmask(kern, res):
    g = _gen(3)
    logits = torch.randn(5, 1000, generator=g)
    mask = torch.randint(-2 ** 31, 2 ** 31 - 1, (3, 32), generator=g, dtype=torch.int64).to(torch.int32)
    kern.apply_token_bitmask(logits, mask, torch.tensor([0, 2, 4]))
    res["apply_token_bitmask"] = logits


def dump(kern) -> dict:
    res: dict[str, torch.Tensor] = {}
    for f in (dump_attention, dump_rope_cache_attention, dump_norm_act, dump_gemm_bf16, dump_gguf, dump_bitmask):
        f(kern, res)
    res["isa"] = kern.vector_kernels_isa()
    res["gemm_gguf_isa"] = kern.gemm_gguf_isa()
    res["gemm_gguf_q8_isa"] = kern.gemm_gguf_q8_isa()
    return res


def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def compare(a: dict, b: dict) -> list[str]:
    """Names of the cases that differ in any bit or exist on one side only."""
    bad = []
    for key in sorted(set(a) | set(b)):
        if key not in a or key not in b:
            bad.append(f"{key}: only in {'the second' if key not in a else 'the first'}")
            continue
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor):
            same = x.dtype == y.dtype and x.shape == y.shape and torch.equal(_bits(x), _bits(y))
        else:
            same = x == y
        if not same:
            bad.append(key)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("dump")
    d.add_argument("--src", type=Path, default=None, help="a kernels/cpu directory (default: this checkout's)")
    d.add_argument("--isa", default="native")
    d.add_argument("--out", type=Path, required=True)
    c = sub.add_parser("compare")
    c.add_argument("first", type=Path)
    c.add_argument("second", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "dump":
        from tinyvllm.kernels.cpu import build_cpu_kernels

        kern = build_cpu_kernels(args.isa, args.src)
        res = dump(kern)
        torch.save(res, args.out)
        n = sum(isinstance(v, torch.Tensor) for v in res.values())
        print(f"{n} outputs of {args.src or 'this checkout'} ({args.isa}: vector isa {res['isa']}, gemm_gguf "
              f"{res['gemm_gguf_isa']}, gemm_gguf_q8 {res['gemm_gguf_q8_isa']}) -> {args.out}")
        return 0
    a, b = torch.load(args.first), torch.load(args.second)
    bad = compare(a, b)
    n = sum(isinstance(v, torch.Tensor) for v in a.values())
    for key in bad:
        print("DIFFERS:", key)
    print(f"{n - len(bad)} of {n} outputs identical bit for bit ({args.first} vs {args.second})")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
