"""``--kv-cache-dtype int8|fp8`` (issue 39): the quantized cache format, the kernels over it, and the
engine's guarantees under each KV dtype.

References are never the code under test: the cache bytes the C++ write path produces are compared
with ``kv_quant.quantize`` (PyTorch ops) applied to the bf16 cache the same kernel writes for the same
inputs; attention outputs with float64 attention over ``kv_quant.dequantize``'s rows; engine outputs
with the same engine run alone / unchunked / without prefix cache or offload."""

from __future__ import annotations

import random
import subprocess
import sys

import pytest
import torch

from tinyvllm import SamplingParams
from tinyvllm.attention import kv_quant
from tinyvllm.config import EngineArgs
from tinyvllm.kernels.cpu import cpu_kernels
from tinyvllm.worker.model_runner import check_kv_cache_dtype
from conftest import assert_no_kv_leak

KINDS = ["int8", "fp8"]
K = cpu_kernels()
needs_kernels = pytest.mark.skipif(K is None, reason="C++ kernels did not build")


# ----------------------------------------------------------------------------- format (PyTorch only)

@pytest.mark.parametrize("kind", KINDS)
def test_quantize_round_trip_error_is_bounded_per_row(kind):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(200, 3, 64, generator=g) * torch.logspace(-3, 2, 200)[:, None, None]
    x[7, 1] = 0.0  # an all-zero row: scale 0, values 0
    rows = kv_quant.quantize(x, kind, torch.bfloat16)
    assert rows.shape == (200, 3, 66) and rows.dtype == (torch.int8 if kind == "int8" else torch.uint8)
    back = kv_quant.dequantize(rows)
    xb = x.bfloat16().float()
    amax = xb.abs().amax(-1, keepdim=True)
    err = (back - xb).abs()
    if kind == "int8":  # half a step of max|x| / 127 (+ the bf16 scale's rounding)
        assert (err <= amax / 127 * 0.5 * (1 + 2**-7) + 1e-30).all()
    else:  # e4m3: 3 mantissa bits, relative 2^-4 above the subnormal range of amax / 448
        assert (err <= torch.maximum(xb.abs() * 2**-4, amax / 448 * 2**-9) * 1.01 + 1e-30).all()
    assert back[7, 1].abs().max() == 0
    # Each row's bytes depend on that row only (the invariance of the cache).
    assert torch.equal(kv_quant.quantize(x[5:6], kind, torch.bfloat16), rows[5:6])


def test_kv_cache_dtype_flag_values_and_errors():
    assert EngineArgs(kv_cache_dtype="fp8_e4m3").create_engine_config().cache_config.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineArgs(kv_cache_dtype="int4").create_engine_config()
    assert kv_quant.canonical_kv_cache_dtype("fp8_e4m3") == "fp8"
    with pytest.raises(ValueError, match="e5m2 is not supported"):
        kv_quant.canonical_kv_cache_dtype("fp8_e5m2")
    assert check_kv_cache_dtype("auto", torch.bfloat16) == "bfloat16"
    assert check_kv_cache_dtype("auto", torch.float32) == "auto"
    assert check_kv_cache_dtype("fp8_e4m3", torch.float32) == "fp8"
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        check_kv_cache_dtype("bfloat16", torch.float32)
    # A quantized cache's bytes per token: D + 2 per (layer, K/V, head) instead of 2 D.
    assert kv_quant.kv_bytes_per_token("int8", torch.bfloat16, 30, 3, 64) == 2 * 30 * 3 * 66
    assert kv_quant.kv_bytes_per_token("auto", torch.bfloat16, 30, 3, 64) == 2 * 30 * 3 * 128


def test_unknown_kv_cache_dtype_is_a_one_line_cli_error():
    r = subprocess.run([sys.executable, "-m", "tinyvllm.entrypoints.cli", "generate", "--kv-cache-dtype", "int4",
                        "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--kv-cache-dtype" in r.stderr and "int4" in r.stderr


# ----------------------------------------------------------------------------- C++ kernels

def _layer(T, hq, hk, d, pos0, nb, bs, seed, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(T, (hq + 2 * hk) * d, generator=g) * 2).to(dtype)
    # a few outlier channels in K, as real models have (one row's scale follows them)
    qkv[:, hq * d:(hq + hk) * d].view(T, hk, d)[:, :, 3] *= 8
    pos = torch.arange(pos0, pos0 + T)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(pos0 + T + 1).float()[:, None] * inv[None]
    blocks = torch.randperm(nb, generator=g)[: (pos0 + T + bs - 1) // bs]
    slots = blocks[pos // bs] * bs + pos % bs
    return qkv, ang.cos(), ang.sin(), pos, slots, blocks[None].long()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_write_path_bytes_equal_quantize_of_the_bf16_cache(kind, dtype):
    hq, hk, d, nb, bs, T = 4, 2, 64, 12, 16, 40
    qkv, cos, sin, pos, slots, bt = _layer(T, hq, hk, d, 0, nb, bs, 1, dtype)
    seq = torch.zeros(T, dtype=torch.int64)
    ref_cache = torch.zeros(2, nb, bs, hk, d, dtype=dtype)
    K.rope_cache_attention(qkv, cos, sin, pos, ref_cache, slots, bt, seq, hq, hk, d ** -0.5)
    elem, extra = kv_quant.kv_storage(kind, dtype)
    qcache = torch.zeros(2, nb, bs, hk, d + extra, dtype=elem)
    K.rope_cache_attention(qkv, cos, sin, pos, qcache, slots, bt, seq, hq, hk, d ** -0.5)
    want = kv_quant.quantize(ref_cache.view(2, -1, hk, d)[:, slots], kind, dtype)
    got = qcache.view(2, -1, hk, d + extra)[:, slots]
    assert torch.equal(got, want)


def _paths():
    out = [("scalar", False, False)]
    if K is not None and K.has_tiled_attention():
        out.append(("vdpbf16ps", True, False))
        if K.has_amx_attention():
            out.append(("amx", True, True))
    return out


def _set_path(vector, amx):
    K.set_vector_kernels(vector)
    if K.has_amx_attention():
        K.set_amx_attention(amx)


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("path", [p[0] for p in _paths()])
def test_attention_over_quantized_cache_matches_float64_on_dequantized_rows(kind, path):
    """Prefill rows over a long cached context, and decode rows: the kernel's error against exact
    attention over the same dequantized K/V stays at the bf16 tiles' level (P and V rounded to bf16),
    and every row's bits equal the same row computed alone (batch invariance)."""
    _, vector, amx = next(p for p in _paths() if p[0] == path)
    hq, hk, d, bs = 6, 2, 64, 16
    ctx, T = 300, 40
    g = torch.Generator().manual_seed(3)
    nb = (ctx + T) // bs + 4
    kv = torch.randn(2, nb * bs, hk, d, generator=g)
    kv[0, :, :, 5] *= 10  # outlier channel in K
    cache = kv_quant.quantize(kv, kind, torch.bfloat16).view(2, nb, bs, hk, d + 2)
    q = torch.randn(T, hq, d, generator=g).bfloat16().float()
    bt = torch.randperm(nb, generator=g)[None].long()
    seq = torch.zeros(T, dtype=torch.int64)
    pos = torch.arange(ctx, ctx + T)
    try:
        _set_path(vector, amx)
        if K.has_int8_attention():  # the bf16-tile kernel; the int8 Q K^T one: the test below
            K.set_int8_attention(False)
        out = K.paged_attention(q, cache[0], cache[1], bt, seq, pos, d ** -0.5)
        alone = torch.stack([K.paged_attention(q[i:i + 1], cache[0], cache[1], bt, seq[:1], pos[i:i + 1],
                                               d ** -0.5)[0] for i in (0, 17, T - 1)])
    finally:
        _set_path(True, True)
        if K.has_int8_attention():
            K.set_int8_attention(True)
    assert torch.equal(out[[0, 17, T - 1]], alone)
    deq = kv_quant.dequantize(cache.view(2, -1, hk, d + 2))[:, (bt[0][:, None] * bs + torch.arange(bs)).reshape(-1)]
    kd, vd = deq[0].double(), deq[1].double()  # [L, hk, d] in logical order
    kd, vd = kd.repeat_interleave(hq // hk, 1), vd.repeat_interleave(hq // hk, 1)  # [L, hq, d]
    s = torch.einsum("thd,lhd->thl", q.double(), kd) * d ** -0.5
    s = s.masked_fill(torch.arange(kd.shape[0])[None, None] > pos[:, None, None], float("-inf"))
    ref = torch.einsum("thl,lhd->thd", torch.softmax(s, -1), vd)
    rel = (out.double() - ref).norm() / ref.norm()
    print(path, kind, float(rel))
    assert rel < (1e-5 if path == "scalar" else 4e-3), rel


def _int8_qk_paths():
    if K is None or not K.has_int8_attention():
        return []
    return ["vnni"] + (["amx"] if K.has_amx_attention() else [])


def _rows_every_way(attn, q, seq, pos):
    """``attn(q, seq, pos)``'s rows, asserted bit for bit equal when computed in two chunks, batched after 25
    rows of a second sequence (block table row 1, positions 100-124) and alone (decode rows 0, 17 and the
    last). Returns the rows and the batched call's output (its first 25 rows are the other sequence's)."""
    T = q.shape[0]
    out = attn(q, seq, pos)
    chunks = torch.cat([attn(q[:17], seq[:17], pos[:17]), attn(q[17:], seq[17:], pos[17:])])
    both = attn(torch.cat([q[5:30], q]), torch.cat([torch.ones(25, dtype=torch.int64), seq]),
                torch.cat([torch.arange(100, 125), pos]))
    decode = torch.stack([attn(q[i:i + 1], seq[:1], pos[i:i + 1])[0] for i in (0, 17, T - 1)])
    assert torch.equal(chunks, out)
    assert torch.equal(both[25:], out)
    assert torch.equal(decode, out[[0, 17, T - 1]])
    return out, both


def _int8_ref(q, cache, bt, bs, pos, d, quantize_q):
    """float64 attention over the dequantized int8 rows (logical order), with the query quantized as
    ``kv_quant.quantize_query`` defines (the scores then (q8 · k8) * qs * s_k, the dot product exact)
    or, for ``quantize_q=False``, the float query itself."""
    hq, hk = q.shape[1], cache.shape[-2]
    rows = cache.view(2, -1, hk, d + 2)[:, (bt[0][:, None] * bs + torch.arange(bs)).reshape(-1)]
    kd, vd = (kv_quant.dequantize(rows[i]).double().repeat_interleave(hq // hk, 1) for i in (0, 1))
    if quantize_q:
        q8, qs = kv_quant.quantize_query(q)
        qd = q8.double() * qs.double()
    else:
        qd = q.double()
    s = torch.einsum("thd,lhd->thl", qd, kd) * d ** -0.5
    s = s.masked_fill(torch.arange(kd.shape[0])[None, None] > pos[:, None, None], float("-inf"))
    return torch.einsum("thl,lhd->thd", torch.softmax(s, -1), vd)


@needs_kernels
@pytest.mark.parametrize("d", [64, pytest.param(128, marks=pytest.mark.slow)])
@pytest.mark.parametrize("path", _int8_qk_paths())
def test_int8_qk_kernel_matches_float64_with_the_same_query_quantization(path, d):
    """The int8 Q K^T kernel (attention_int8.h; VPDPBUSD with the +128 offset, or AMX-INT8): against
    float64 attention whose query is quantized by ``kv_quant.quantize_query`` over the same int8 K/V,
    the error is the bf16 P / V tiles' (a few 1e-3), several times below the error against the float
    query (so the reference sees the kernel's Q quantization, not only P / V rounding). Rows are
    bit for bit the same whether computed together, split into two chunks, or batched with another
    sequence (chunk / batch invariance). The int8 Q K^T is not the bf16-tile kernel (outputs differ).
    P V in bf16 here on both paths (the vector path's default int8 P V has its own tests below)."""
    hq, hk, bs = 6, 2, 16
    ctx, T = 300, 40
    g = torch.Generator().manual_seed(5)
    nb = 2 * ((ctx + T) // bs + 2)
    kv = torch.randn(2, nb * bs, hk, d, generator=g)
    kv[0, :, :, 5] *= 10  # outlier channel in K
    cache = kv_quant.quantize(kv, "int8", torch.bfloat16).view(2, nb, bs, hk, d + 2)
    q = torch.randn(T, hq, d, generator=g) * 2
    q[:, :, 3] += 4  # an outlier channel in Q too
    bt = torch.randperm(nb, generator=g).view(2, -1).long()  # two sequences' block tables
    seq = torch.zeros(T, dtype=torch.int64)
    pos = torch.arange(ctx, ctx + T)
    sc = d ** -0.5

    def attn(qq, ss, pp):
        return K.paged_attention(qq, cache[0], cache[1], bt, ss, pp, sc)

    try:
        _set_path(True, path == "amx")
        K.set_int8_attention(True, pv8=False)  # bf16 P V (AMX's; the vector path's int8 P V: tests below)
        out, both = _rows_every_way(attn, q, seq, pos)
        K.set_int8_attention(False)
        bf16_tiles = attn(q, seq, pos)
    finally:
        K.set_int8_attention(True)
        _set_path(True, True)
    assert not torch.equal(bf16_tiles, out)
    ref_q8 = _int8_ref(q, cache, bt[:1], bs, pos, d, True)
    ref_f = _int8_ref(q, cache, bt[:1], bs, pos, d, False)
    rel_q8 = float((out.double() - ref_q8).norm() / ref_q8.norm())
    rel_f = float((out.double() - ref_f).norm() / ref_f.norm())
    print(path, d, rel_q8, rel_f)
    assert rel_q8 < 4e-3 and rel_q8 < rel_f / 3, (rel_q8, rel_f)
    # the other sequence's rows against their own reference
    ref1 = _int8_ref(q[5:30], cache, bt[1:], bs, torch.arange(100, 125), d, True)
    assert float((both[:25].double() - ref1).norm() / ref1.norm()) < 4e-3


def _pv8_ref(q, cache, bt, bs, pos, d, tile=64):
    """(int8 P V emulated, exact) float64 attention over the int8 rows, the query quantized as the kernel
    does. The emulation quantizes P'_j = P_j * s_v(j) per (row, head, 64-position tile of the logical
    positions) to round_half_even(255 * P' / max_tile P') and multiplies those bytes by V's int8 values,
    as attention_int8.h's tile_pv8 documents; ``exact`` is plain softmax(S) V over the dequantized V."""
    hq, hk = q.shape[1], cache.shape[-2]
    rows = cache.view(2, -1, hk, d + 2)[:, (bt[0][:, None] * bs + torch.arange(bs)).reshape(-1)]
    kd = kv_quant.dequantize(rows[0]).double().repeat_interleave(hq // hk, 1)
    v8 = rows[1][..., :d].double().repeat_interleave(hq // hk, 1)  # [L, hq, d]
    sv = rows[1][..., d:].contiguous().view(torch.bfloat16)[..., 0].double().repeat_interleave(hq // hk, 1)
    q8, qs = kv_quant.quantize_query(q)
    s = torch.einsum("thd,lhd->thl", q8.double() * qs.double(), kd) * d ** -0.5
    s = s.masked_fill(torch.arange(kd.shape[0])[None, None] > pos[:, None, None], float("-inf"))
    w = torch.exp(s - s.amax(-1, keepdim=True))  # [T, hq, L]
    pp = w * sv.T[None]
    emu = torch.zeros(q.shape[0], hq, d, dtype=torch.float64)
    for t0 in range(0, kd.shape[0], tile):
        blk = pp[..., t0:t0 + tile]
        m = blk.amax(-1, keepdim=True)
        p8 = torch.round(blk * 255 / m.clamp_min(1e-300))
        emu += (m / 255) * torch.einsum("thl,lhd->thd", p8, v8[t0:t0 + tile])
    exact = torch.einsum("thl,lhd->thd", pp, v8)
    return emu / w.sum(-1, keepdim=True), exact / w.sum(-1, keepdim=True)


needs_int8_attention = pytest.mark.skipif(K is None or not K.has_int8_attention(),
                                          reason="the int8 attention kernel (AVX512-VNNI + BF16) is not built here")


@needs_int8_attention
@pytest.mark.parametrize("d", [64, 128])
def test_int8_pv_kernel_is_the_documented_rounding_of_p(d):
    """The int8 P V (the vector path's default; set_int8_attention(pv8=...)): with every score equal (q = 0) and
    V scales that are powers of two with 1 in each 64-position tile, the rounded bytes p8 are known
    exactly (255 * 2^-k, never a tie), so the kernel must equal the float64 emulation of its rounding
    to float32 accuracy. That pins the packing of V (4 positions per word, the dims back in order), the
    folded V scales, the tile grid and the causal mask of the last tile; the emulation itself differs
    from exact attention by the rounding of P (the check can see a kernel that skipped it)."""
    hq, hk, bs = 6, 2, 16
    ctx, T = 300, 40
    g = torch.Generator().manual_seed(8)
    nb = (ctx + T) // bs + 4
    n = nb * bs
    cache = torch.randint(-127, 128, (2, n, hk, d + 2), generator=g, dtype=torch.int8)
    exps = torch.tensor([0, 2, 3, 4, 5, 6, 7, 9, 11])[torch.randint(0, 9, (n, hk), generator=g)]
    bt = torch.randperm(nb, generator=g)[None].long()
    logical = (bt[0][:, None] * bs + torch.arange(bs)).reshape(-1)  # cache slot of each position
    exps[logical[::64]] = 0  # scale 1 at each tile's first position
    cache[0, :, :, d:] = torch.tensor([0.01]).bfloat16().view(torch.int8)  # K scales: finite (q = 0 anyway)
    cache[1, :, :, d:] = (2.0 ** -exps.float()).bfloat16()[..., None].view(torch.int8)  # the scale's 2 bytes
    cache = cache.view(2, nb, bs, hk, d + 2)
    seq = torch.zeros(T, dtype=torch.int64)
    pos = torch.arange(ctx, ctx + T)
    q = torch.zeros(T, hq, d)
    try:
        _set_path(True, False)
        K.set_int8_attention(True, pv8=True)
        out = K.paged_attention(q, cache[0], cache[1], bt, seq, pos, d ** -0.5).double()
    finally:
        K.set_int8_attention(True)
        _set_path(True, True)
    emu, exact = _pv8_ref(q, cache, bt, bs, pos, d)
    rel_emu = float((out - emu).norm() / emu.norm())
    rel_exact = float((emu - exact).norm() / exact.norm())
    print(d, rel_emu, rel_exact)
    assert rel_emu < 1e-5 and rel_exact > 1e-3, (rel_emu, rel_exact)


@needs_int8_attention
@pytest.mark.parametrize("d", [64, pytest.param(128, marks=pytest.mark.slow)])
def test_int8_pv_kernel_matches_its_emulation_and_is_invariant(d):
    """The int8 P V on realistic scores: the kernel is near the float64 emulation of its rounding (the
    remaining gap: float32 arithmetic flipping near-ties of P's rounding), its error against exact
    attention is the emulation's (P's 8-bit rounding, a few 1e-3), and rows are bit for bit the same
    computed together, in two chunks, batched with another sequence, or alone (decode)."""
    hq, hk, bs = 6, 2, 16
    ctx, T = 300, 40
    g = torch.Generator().manual_seed(6)
    nb = 2 * ((ctx + T) // bs + 2)
    kv = torch.randn(2, nb * bs, hk, d, generator=g)
    kv[1] *= torch.rand(nb * bs, hk, 1, generator=g) * 3  # V scales that vary along the reduction
    cache = kv_quant.quantize(kv, "int8", torch.bfloat16).view(2, nb, bs, hk, d + 2)
    q = torch.randn(T, hq, d, generator=g) * 2
    bt = torch.randperm(nb, generator=g).view(2, -1).long()
    seq = torch.zeros(T, dtype=torch.int64)
    pos = torch.arange(ctx, ctx + T)

    def attn(qq, ss, pp):
        return K.paged_attention(qq, cache[0], cache[1], bt, ss, pp, d ** -0.5)

    try:
        _set_path(True, False)
        K.set_int8_attention(True, pv8=True)
        out, _ = _rows_every_way(attn, q, seq, pos)
        K.set_int8_attention(True, pv8=False)
        bf16_pv = attn(q, seq, pos)
    finally:
        K.set_int8_attention(True)
        _set_path(True, True)
    assert not torch.equal(bf16_pv, out)
    emu, exact = _pv8_ref(q, cache, bt[:1], bs, pos, d)
    rel_emu = float((out.double() - emu).norm() / emu.norm())
    rel_exact = float((out.double() - exact).norm() / exact.norm())
    rel_emu_exact = float((emu - exact).norm() / exact.norm())
    print(d, rel_emu, rel_exact, rel_emu_exact)
    assert rel_emu < 0.3 * rel_emu_exact and rel_exact < 1.3 * rel_emu_exact < 1e-2, (rel_emu, rel_exact, rel_emu_exact)


# ----------------------------------------------------------------------------- engine

def _prompts(llm, n=6, seed=1):
    from conftest import CHAT_PROMPTS

    rng = random.Random(seed)
    ids = [llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:3]]
    ids += [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 90))] for _ in range(n - 3)]
    return [{"prompt_token_ids": p} for p in ids]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def _invariance(make_smol_llm, kind):
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    base = make_smol_llm(kv_cache_dtype=kind)
    assert base.llm_engine.core.runner.kv_caches[0].shape[-1] == 66
    prompts = _prompts(base)
    alone = [base.generate(p, sp)[0].outputs[0].token_ids for p in prompts]
    batched = _tokens(base.generate(prompts, sp))  # batched, and each prompt now a prefix-cache hit
    chunked = make_smol_llm(kv_cache_dtype=kind, max_num_batched_tokens=24, enable_prefix_caching=False)
    small = make_smol_llm(kv_cache_dtype=kind, num_kv_blocks=14)  # preemptions: recomputed
    assert batched == alone
    assert _tokens(chunked.generate(prompts, sp)) == alone
    assert _tokens(small.generate(prompts, sp)) == alone
    assert small.stats()["num_preemptions"] > 0
    for llm in (base, chunked, small):
        assert_no_kv_leak(llm)


def _int8_engine_paths():
    """The AVX-512 vector path (the int8 P V) in the default tier; AMX, where present, in the slow one
    (its kernel's rows are checked for chunk / batch invariance by the kernel test above)."""
    if K is not None and K.has_amx_attention():
        return ["vector", pytest.param("amx", marks=pytest.mark.slow)]
    return ["vector"]


@needs_kernels
@pytest.mark.parametrize("path", _int8_engine_paths())
def test_int8_greedy_outputs_invariant_to_batch_chunking_prefix_cache_and_preemption(make_smol_llm, path):
    """The engines run in this process, so the kernel path chosen here is theirs."""
    try:
        _set_path(True, path == "amx")
        _invariance(make_smol_llm, "int8")
    finally:
        _set_path(True, True)


@pytest.mark.slow
@needs_kernels
def test_fp8_greedy_outputs_invariant_to_batch_chunking_prefix_cache_and_preemption(make_smol_llm):
    _invariance(make_smol_llm, "fp8")


@needs_kernels
def test_int8_blocks_and_scales_survive_the_offload_tier_and_disk(make_smol_llm, tmp_path):
    """Host tier: sessions larger than the pool give the same outputs with the tier (blocks evicted and
    loaded back, scales inside). Disk tier: an int8 run's blocks are hits after a restart with int8 and
    foreign (ignored) for a bf16 run and a fp8 run."""
    rng = random.Random(7)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    turn1 = [rng.randrange(100, 40000) for _ in range(100)]
    a = make_smol_llm(kv_cache_dtype="int8", kv_offload_size="16MiB", kv_offload_path=str(tmp_path))
    o1 = a.generate({"prompt_token_ids": turn1}, sp)[0]
    del a
    turn2 = turn1 + o1.outputs[0].token_ids + [rng.randrange(100, 40000) for _ in range(30)]
    for kind, hits in (("int8", 96), ("fp8", 0), ("bfloat16", 0)):
        b = make_smol_llm(kv_cache_dtype=kind, kv_offload_size="16MiB", kv_offload_path=str(tmp_path))
        o2 = b.generate({"prompt_token_ids": turn2}, sp)[0]
        assert o2.num_cached_tokens_tier == hits, kind
        if kind == "int8":
            ref = make_smol_llm(kv_cache_dtype="int8").generate({"prompt_token_ids": turn2}, sp)[0]
            assert o2.outputs[0].token_ids == ref.outputs[0].token_ids
        assert_no_kv_leak(b)
        del b


@needs_kernels
def test_int8_pool_holds_twice_the_tokens_at_the_same_memory(make_smol_llm):
    bf = make_smol_llm(kv_cache_memory="64MiB")
    i8 = make_smol_llm(kv_cache_memory="64MiB", kv_cache_dtype="int8")
    ratio = i8.llm_engine.core.num_blocks / bf.llm_engine.core.num_blocks
    assert 1.9 < ratio < 1.95  # 128 / 66 bytes per (token, head) at D = 64
