"""Sliding-window attention (Mistral's ``sliding_window``, Gemma 3's local layers): a query at position
``p`` attends to the keys at ``p - window + 1 .. p`` (transformers' ``sliding_window_overlay``:
``kv_idx > q_idx - sliding_window``).

Kernels: the C++ paged attention on every path (scalar, the AVX-512 / AVX2 row kernel, the tiled bf16
kernel on vdpbf16ps and on AMX, int8 / fp8 caches) against float64 attention with the window's mask,
never against another kernel. The Triton kernels' window: tests/test_triton_kernels.py; the models
(Mistral, Gemma 3 against transformers, every engine path): tests/test_model_families.py.
"""

from __future__ import annotations

import pytest
import torch

from tinyvllm.attention import kv_quant
from tinyvllm.kernels.cpu import cpu_kernels

KERN = cpu_kernels()
needs_kernels = pytest.mark.skipif(KERN is None, reason="C++ kernels could not be built")

# (path name, vector kernels on, AMX on)
PATHS = [("scalar", False, False)]
if KERN is not None and KERN.vector_kernels_isa() != "none":
    PATHS.append(("vector", True, False))
    if KERN.has_amx_attention():
        PATHS.append(("amx", True, True))


def _set_path(vector: bool, amx: bool) -> None:
    KERN.set_vector_kernels(vector)
    if KERN.has_amx_attention():
        KERN.set_amx_attention(amx)


# (cached context, new tokens): a chunk after a long prefix (it crosses 64-position KV tiles and more
# than one 64-row work item), a decode row far into its context, a fresh short prompt.
SEQS = [(150, 90), (200, 1), (0, 9)]
HQ, HK, D, BS = 6, 2, 64, 16


def _batch(cache_kind: str, seed: int = 0):
    """Kernel inputs over shuffled blocks, and the logical K/V [L, Hk, D] float64 of each sequence
    (dequantized for int8 / fp8: the kernel's own rows, so the reference differs from it only by the
    attention arithmetic)."""
    g = torch.Generator().manual_seed(seed)
    nbs = [(c + n + BS - 1) // BS for c, n in SEQS]
    total = sum(nbs) + 2
    perm = torch.randperm(total, generator=g).tolist()
    kv = torch.randn(2, total * BS, HK, D, generator=g)
    if cache_kind in ("int8", "fp8"):
        cache = kv_quant.quantize(kv, cache_kind, torch.bfloat16).view(2, total, BS, HK, D + 2)
        logical = kv_quant.dequantize(cache.view(2, total * BS, HK, D + 2)).double()
    else:
        dt = torch.float32 if cache_kind == "float32" else torch.bfloat16
        cache = kv.to(dt).view(2, total, BS, HK, D)
        logical = kv.to(dt).double()
    tables, kvs, qs, seq, pos = [], [], [], [], []
    for i, ((c, n), nb) in enumerate(zip(SEQS, nbs)):
        blocks = [perm.pop() for _ in range(nb)]
        tables.append(blocks)
        slots = (torch.tensor(blocks)[:, None] * BS + torch.arange(BS)).reshape(-1)[: c + n]
        kvs.append(logical[:, slots])
        qs.append(torch.randn(n, HQ, D, generator=g).bfloat16().float())
        seq += [i] * n
        pos += list(range(c, c + n))
    bt = torch.zeros(len(SEQS), max(nbs), dtype=torch.int64)
    for i, b in enumerate(tables):
        bt[i, : len(b)] = torch.tensor(b)
    return (torch.cat(qs), cache[0], cache[1], bt, torch.tensor(seq), torch.tensor(pos)), kvs


def _reference(q: torch.Tensor, kvs, seq: torch.Tensor, pos: torch.Tensor, window: int) -> torch.Tensor:
    """float64 softmax(q k^T * D^-0.5 masked to keys pos - window + 1 .. pos) v, per sequence."""
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, (k, v) in enumerate(kvs):
        rows = (seq == i).nonzero().flatten()
        p = pos[rows]
        kpos = torch.arange(k.shape[0])[None, :]
        mask = (kpos <= p[:, None]) & (kpos > p[:, None] - window)  # [n, L]
        s = torch.einsum("nhd,lhd->nhl", q[rows].double(), k.repeat_interleave(HQ // HK, 1)) * D ** -0.5
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        out[rows] = torch.einsum("nhl,lhd->nhd", s.softmax(-1), v.repeat_interleave(HQ // HK, 1))
    return out


# Default tier: the tiled kernel on a bf16 and an int8 cache, the AVX-512 row kernel (float32 cache) and
# the scalar loops (bf16 cache); the other path x cache kind pairs (vdpbf16ps tiled, scalar int8 / fp8,
# ...) are `slow`.
_TILED = "amx" if any(p[0] == "amx" for p in PATHS) else "vector"
DEFAULT_CASES = {(_TILED, "bfloat16"), (_TILED, "int8"), ("vector", "float32"), ("scalar", "bfloat16")}


@needs_kernels
@pytest.mark.parametrize("path,cache_kind", [
    pytest.param(p[0], k, marks=() if (p[0], k) in DEFAULT_CASES else pytest.mark.slow)
    for p in PATHS for k in ("float32", "bfloat16", "int8", "fp8")])
def test_kernel_window_matches_masked_reference(path, cache_kind):
    """Every window size on every kernel path: within the path's bound of the masked float64 reference;
    rows alone (a decode, rows cut from the middle of the chunk) equal their rows in the batch bit for
    bit (the invariance the engine's exactness rests on); a window longer than every context gives the
    bits of no window; and whole blocks before a decode row's window are never read (NaN there)."""
    _, vector, amx = next(p for p in PATHS if p[0] == path)
    args, kvs = _batch(cache_kind)
    q, kc, vc, bt, seq, pos = args
    scale = D ** -0.5
    tiled = path != "scalar" and cache_kind != "float32" and KERN.has_tiled_attention()
    outs = {}
    try:
        _set_path(vector, amx)
        for window in (1, 5, 16, 64, 100):
            out = outs[window] = KERN.paged_attention(q, kc, vc, bt, seq, pos, scale, window=window)
            ref = _reference(q, kvs, seq, pos, window)
            assert torch.isfinite(out).all()
            if tiled:  # P and V rounded to bf16 (tests/test_cpu_kernels.py's bound)
                atol = 2 ** -8 * max(float(v.abs().max()) for _, v in kvs)
                torch.testing.assert_close(out.double(), ref, rtol=0.0, atol=atol)
            else:
                torch.testing.assert_close(out.double(), ref, rtol=2e-5, atol=2e-5)
            for rows in ([90], [3, 4, 5], list(range(60, 75))):  # decode row; pieces of the chunk
                s = int(seq[rows[0]])
                alone = KERN.paged_attention(q[rows], kc, vc, bt[s:s + 1], torch.zeros(len(rows), dtype=torch.int64),
                                             pos[rows], scale, window=window)
                assert torch.equal(alone, out[rows]), (window, rows)
        no_window = KERN.paged_attention(q, kc, vc, bt, seq, pos, scale)
        assert torch.equal(KERN.paged_attention(q, kc, vc, bt, seq, pos, scale, window=1000), no_window)
        if cache_kind in ("float32", "bfloat16"):  # skipped, not masked: NaN in the blocks before the window
            window, t = 16, 90  # the decode row at position 200: keys 185..200
            kc2, vc2 = kc.clone(), vc.clone()
            for b in bt[1, : 128 // BS]:  # positions 0..127: before the 64-position tile that holds key 185
                kc2[b], vc2[b] = float("nan"), float("nan")
            one = KERN.paged_attention(q[t:t + 1], kc2, vc2, bt[1:2], torch.zeros(1, dtype=torch.int64), pos[t:t + 1],
                                       scale, window=window)
            assert torch.equal(one, outs[window][t:t + 1])
    finally:
        _set_path(True, True)
