"""Triton attention kernels over a paged KV cache, and their Python launchers.

The kernels run natively on CUDA, and on CPU tensors under the Triton
interpreter (``TRITON_INTERPRET=1``, set before ``triton`` is imported), which
is how the test suite proves them correct on machines without a GPU.

Conventions (shared with the rest of the engine):

* ``q`` ``[num_tokens, num_heads, head_dim]``; ``k``/``v``
  ``[num_tokens, num_kv_heads, head_dim]``; query head ``h`` reads KV head
  ``h // (num_heads // num_kv_heads)`` (GQA).
* ``key_cache``/``value_cache`` ``[num_blocks, block_size, num_kv_heads,
  head_dim]`` (views of one ``[2, ...]`` tensor; any strides are accepted as
  long as ``head_dim`` is contiguous).
* ``slot_mapping`` ``[num_tokens]`` int64, ``slot = block * block_size +
  offset``; ``-1`` means "do not store" (padding).
* ``block_tables`` ``[num_seqs, max_blocks_per_seq]`` int32, ``seq_lens``
  ``[num_seqs]`` int32 (context length *including* this step's tokens),
  ``query_start_loc`` ``[num_seqs + 1]`` int32.

Three kernels:

1. :func:`reshape_and_cache` - scatter new K/V rows into their cache slots.
2. :func:`paged_decode_attention` - one query token per sequence; the context
   is split across programs and the partial results merged by a second
   kernel (flash-decoding, Dao et al. 2023).  All query heads of one KV head
   are processed together so each K/V tile is read once per group.
3. :func:`paged_prefill_attention` - a packed batch of query chunks; each
   chunk attends to its sequence's cached prefix and causally to itself, all
   read through the block table (FlashAttention-2 style online softmax).

Quantized caches (``--kv-cache-dtype int8|fp8``; the layout is
:mod:`tinyvllm.attention.kv_quant`'s): a cache of one-byte elements whose rows
are ``[head_dim values, the 2 bytes of a bfloat16 scale]``, one scale per
(token, KV head); ``torch.int8`` holds int8 values, ``torch.uint8`` fp8 e4m3
bits. The caller quantizes the rows it stores (:func:`reshape_and_cache` copies
``head_dim + 2`` bytes); both attention kernels read the values and scales in
the tile loop: ``s = (q . k_q) * s_k`` (K's scale is per key, so it factors out
of the dot product, as SageAttention applies its scales after the integer dot
product, Zhang et al., ICLR 2025; int8 and e4m3 values are exact in bf16 and
fp16, so the dot runs in q's dtype), and ``V = s_v * v_q`` rounded once to q's
dtype before ``P V``. e4m3 is decoded with integer ops (exact; sm_89's fp8
conversions are not needed).

All softmax math is float32 (scores in the log2 domain, ``exp2``); outputs
take ``q``'s dtype.  No launcher reads device values on the host, so the
launchers do not synchronise and are CUDA-graph friendly for fixed shapes.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import triton
import triton.language as tl

__all__ = [
    "reshape_and_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "default_num_splits",
]

_LOG2E = 1.4426950408889634


def _interpreting() -> bool:
    # ``triton.jit`` decides at decoration time whether a kernel is compiled or
    # interpreted; ask the kernel object itself.
    return type(_reshape_and_cache_kernel).__name__ == "InterpretedFunction"


def _upcast_for_dot(dtype: torch.dtype) -> bool:
    # The interpreter stores bfloat16 as raw uint16 and its ``tl.dot`` would
    # multiply the bit patterns; upcast bf16 operands to fp32 there.  On a GPU
    # bf16/fp16 operands go to the tensor cores with an fp32 accumulator.
    return dtype == torch.bfloat16 and _interpreting()


def _device_ctx(t: torch.Tensor):
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


# Quantized cache formats (the ``KV_QUANT`` constexpr), by the cache's element dtype. The layout is
# kv_quant's (its _STORAGE and SCALE_BYTES); restated here because the kernels sit below tinyvllm.attention
# in the layering contract (pyproject.toml), and tests/test_triton_kernels.py checks the two agree.
_KV_QUANT = {torch.int8: 1, torch.uint8: 2}  # 1: int8 values; 2: fp8 e4m3 bits
SCALE_BYTES = 2  # the bfloat16 scale at the end of each quantized row


def _kv_quant(key_cache: torch.Tensor) -> int:
    """0 for a float cache, 1 for int8, 2 for fp8 e4m3 (stored as uint8)."""
    return _KV_QUANT.get(key_cache.dtype, 0)


def _cache_head_dim(key_cache: torch.Tensor) -> int:
    """The head_dim a cache holds: its last dim, less the scale's bytes for a quantized cache."""
    return key_cache.shape[-1] - (SCALE_BYTES if _kv_quant(key_cache) else 0)


def _paged_strides(q, key_cache, value_cache, block_tables, out) -> tuple[int, ...]:
    """The stride arguments both attention kernels take, in their order: q's token and head strides, each
    cache's block, slot and head strides, the block table's row stride, out's token and head strides."""
    return (*q.stride()[:2], *key_cache.stride()[:3], *value_cache.stride()[:3], block_tables.stride(0),
            *out.stride()[:2])


def _check_q(q: torch.Tensor, key_cache: torch.Tensor) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [tokens, num_heads, head_dim], got {tuple(q.shape)}")
    if q.dtype != key_cache.dtype and not _kv_quant(key_cache):
        raise ValueError(f"q dtype {q.dtype} != KV cache dtype {key_cache.dtype}")
    if q.device != key_cache.device:
        raise ValueError(f"q is on {q.device} but the KV cache is on {key_cache.device}")


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor) -> None:
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache/value_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
            f"got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("the KV cache's head_dim must be contiguous")


# ---------------------------------------------------------------------------
# 1. reshape_and_cache
# ---------------------------------------------------------------------------


@triton.jit
def _reshape_and_cache_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    block_size,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return
    blk = slot // block_size
    off = slot % block_size

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)

    src_k = k_ptr + tok.to(tl.int64) * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :]
    src_v = v_ptr + tok.to(tl.int64) * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :]
    dst_k = kc_ptr + blk * stride_kcb + off * stride_kcs + offs_h[:, None] * stride_kch + offs_d[None, :]
    dst_v = vc_ptr + blk * stride_vcb + off * stride_vcs + offs_h[:, None] * stride_vch + offs_d[None, :]

    k = tl.load(src_k, mask=mask)
    v = tl.load(src_v, mask=mask)
    tl.store(dst_k, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(dst_v, v.to(vc_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Write ``k``/``v`` rows ``[num_tokens, num_kv_heads, head_dim]`` into the
    paged cache at ``slot_mapping`` (slot ``-1`` rows are skipped).  In place.
    A quantized cache takes rows already quantized to its format (``head_dim
    + 2`` one-byte elements, ``kv_quant.quantize``): they are copied as bytes."""
    _check_cache(key_cache, value_cache)
    num_tokens, num_kv_heads, head_dim = k.shape
    if v.shape != k.shape:
        raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if key_cache.shape[2:] != (num_kv_heads, head_dim):
        raise ValueError(f"cache is {tuple(key_cache.shape)} but k is {tuple(k.shape)}")
    if slot_mapping.shape[0] < num_tokens:
        raise ValueError("slot_mapping is shorter than k")
    if num_tokens == 0:
        return
    k = _last_dim_contiguous(k)
    v = _last_dim_contiguous(v)
    block_size = key_cache.shape[1]
    with _device_ctx(k):
        _reshape_and_cache_kernel[(num_tokens,)](
            k,
            v,
            key_cache,
            value_cache,
            slot_mapping,
            k.stride(0),
            k.stride(1),
            v.stride(0),
            v.stride(1),
            key_cache.stride(0),
            key_cache.stride(1),
            key_cache.stride(2),
            value_cache.stride(0),
            value_cache.stride(1),
            value_cache.stride(2),
            block_size,
            NUM_KV_HEADS=num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_H=triton.next_power_of_2(num_kv_heads),
            BLOCK_D=triton.next_power_of_2(head_dim),
            num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
        )


# ---------------------------------------------------------------------------
# The KV-tile step both attention kernels share
# ---------------------------------------------------------------------------


@triton.jit
def _dequant_values(raw, KV_QUANT: tl.constexpr):
    """Quantized values -> float32, unscaled: int8 as is; fp8 e4m3 bits (sign, 4 exponent bits of bias 7,
    3 mantissa bits; no NaN is ever stored) decoded with integer ops, exact."""
    if KV_QUANT == 1:
        return raw.to(tl.float32)
    b = raw.to(tl.int32) & 0xFF
    e = (b >> 3) & 0xF
    m = b & 7
    # normal: (8 + m) * 2^(e - 10); subnormal (e == 0): m * 2^-9. 2^x built from its bits.
    pow2 = ((tl.maximum(e, 1) - 10 + 127) << 23).to(tl.float32, bitcast=True)
    mag = (tl.where(e > 0, m + 8, m)).to(tl.float32) * pow2
    return tl.where(b >= 128, -mag, mag)


@triton.jit
def _load_row_scale(row_ptr, mask, HEAD_DIM: tl.constexpr):
    """The bfloat16 scale stored in bytes ``HEAD_DIM`` (low) and ``HEAD_DIM + 1`` (high) of each quantized
    row (``row_ptr`` [N] one-byte pointers), as float32 [N]; 0 where ``mask`` is off."""
    lo = tl.load(row_ptr + HEAD_DIM, mask=mask, other=0).to(tl.int32) & 0xFF
    hi = tl.load(row_ptr + HEAD_DIM + 1, mask=mask, other=0).to(tl.int32) & 0xFF
    return ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)


@triton.jit
def _attend_kv_tile(
    q,
    m_i,
    l_i,
    acc,
    kc_ptr,
    vc_ptr,
    bt_row,
    kvh,
    n0,
    kv_lo,
    kv_end,
    q_pos,
    win,
    offs_d,
    d_mask,
    scale_log2,
    block_size,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    """One KV tile (positions ``n0 .. n0 + BLOCK_N - 1``, those in ``[kv_lo, kv_end)``) of the online
    softmax (FlashAttention-2, Dao 2023) for a block of query rows ``q`` ``[R, BLOCK_D]`` attending to KV
    head ``kvh`` through the block table row ``bt_row``: scores in base 2 (``scale_log2``), the running
    max ``m_i`` and sum ``l_i`` ``[R]`` rescaled, ``acc`` ``[R, BLOCK_D]`` += P V. ``CAUSAL``: row ``r``
    sees keys ``q_pos[r] - win < j <= q_pos[r]`` only (prefill; ``win`` > the context: no window); else
    every key of the tile (decode). A row that sees no key yet keeps ``m_i`` = -inf and adds nothing
    (``m_safe``). ``KV_QUANT`` 1/2: an int8/fp8 cache, values dequantized in registers and each key's
    scale (the row's bytes ``HEAD_DIM``, ``HEAD_DIM + 1``) applied to its score and to its V row.
    Returns ``(m_i, l_i, acc)``."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = (offs_n < kv_end) & (offs_n >= kv_lo)
    blk = tl.load(bt_row + offs_n // block_size, mask=n_mask, other=0).to(tl.int64)
    tok = (offs_n % block_size).to(tl.int64)
    # K^T tile [BLOCK_D, BLOCK_N]
    k_row = kc_ptr + blk * stride_kcb + tok * stride_kcs + kvh * stride_kch  # [BLOCK_N] row starts
    k = tl.load(k_row[None, :] + offs_d[:, None], mask=n_mask[None, :] & d_mask[:, None], other=0)
    if KV_QUANT == 0:
        if UPCAST:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision="ieee") * scale_log2
    else:
        k = _dequant_values(k, KV_QUANT).to(q.dtype)  # exact in bf16/fp16/fp32
        s_k = _load_row_scale(k_row, n_mask, HEAD_DIM)
        s = tl.dot(q, k, input_precision="ieee") * (s_k * scale_log2)[None, :]
    if CAUSAL:
        allowed = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None]) & (offs_n[None, :] > q_pos[:, None] - win)
    else:
        allowed = n_mask[None, :]
    s = tl.where(allowed, s, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)

    # V tile [BLOCK_N, BLOCK_D]
    v_row = vc_ptr + blk * stride_vcb + tok * stride_vcs + kvh * stride_vch
    v = tl.load(v_row[:, None] + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0)
    if KV_QUANT == 0:
        if UPCAST:
            v = v.to(tl.float32)
    else:
        # V = diag(s_v) V_q, rounded once to q's dtype (as the CPU kernels round it to bf16): V keeps its own
        # magnitude, where folding s_v into P would push P's small entries into fp16's subnormals.
        v = (_dequant_values(v, KV_QUANT) * _load_row_scale(v_row, n_mask, HEAD_DIM)[:, None]).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    return m_new, l_i, acc


# ---------------------------------------------------------------------------
# 2. paged decode attention (flash-decoding)
# ---------------------------------------------------------------------------


@triton.jit
def _decode_split_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    seq_lens_ptr,
    out_ptr,
    po_ptr,
    plse_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    stride_ot,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    block_size,
    tokens_per_split,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DIRECT: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, seq_len)
    # Sliding window (window > 0): keys [seq_len - window, seq_len) only; whole tiles before it skipped.
    lo_key = tl.maximum(seq_len - tl.where(window > 0, window, seq_len), 0)
    start = tl.maximum(start, lo_key // BLOCK_N * BLOCK_N)

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_h
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(
        q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, n0, lo_key, end, offs_h, 0, offs_d, d_mask, scale_log2,
            block_size,
            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            BLOCK_N=BLOCK_N, CAUSAL=False, UPCAST=UPCAST, KV_QUANT=KV_QUANT, HEAD_DIM=HEAD_DIM,
        )

    has = l_i > 0.0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    out_mask = h_mask[:, None] & d_mask[None, :]
    if DIRECT:
        tl.store(
            out_ptr + seq.to(tl.int64) * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(
            po_ptr + seq.to(tl.int64) * stride_pos + heads[:, None] * stride_poh + split * stride_pop + offs_d[None, :],
            o,
            mask=out_mask,
        )
        tl.store(plse_ptr + seq.to(tl.int64) * stride_pls + heads * stride_plh + split, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    po_ptr,
    plse_ptr,
    num_splits,
    stride_ot,
    stride_oh,
    stride_pos,
    stride_poh,
    stride_pop,
    stride_pls,
    stride_plh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    d_mask = offs_d < HEAD_DIM

    lse = tl.load(plse_ptr + seq.to(tl.int64) * stride_pls + head * stride_plh + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, axis=0)
    valid = lse > float("-inf")
    w = tl.where(valid, tl.exp2(lse - tl.where(m > float("-inf"), m, 0.0)), 0.0)
    denom = tl.sum(w, axis=0)
    po = tl.load(
        po_ptr + seq.to(tl.int64) * stride_pos + head * stride_poh + offs_s[:, None] * stride_pop + offs_d[None, :],
        mask=valid[:, None] & d_mask[None, :],
        other=0.0,
    )
    o = tl.sum(po * w[:, None], axis=0) / tl.where(denom > 0.0, denom, 1.0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, o.to(out_ptr.dtype.element_ty), mask=d_mask)


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, device: torch.device) -> int:
    """Heuristic split count: enough programs to fill the GPU, but never
    splits shorter than ~256 tokens (where the merge costs more than it gains).
    Uses only host-side shapes, so it never synchronises."""
    if device.type == "cuda":
        target = 2 * _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    else:
        target = 4
    want = triton.cdiv(target, max(1, num_seqs * num_kv_heads))
    cap = max(1, triton.cdiv(max_context, 256))
    return int(max(1, min(want, cap, 64)))


def paged_decode_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Attention of one query token per sequence over its paged context.

    ``q`` ``[num_seqs, num_heads, head_dim]`` -> ``[num_seqs, num_heads, head_dim]``
    in ``q.dtype``.  The new token's K/V must already be in the cache
    (``seq_lens`` counts it).  A sequence with ``seq_len == 0`` gets zeros.
    ``num_splits`` (``None`` = heuristic) splits each context into that many
    contiguous ranges processed by separate programs and merged by a second
    kernel; ``1`` skips the merge.  ``block_n`` is the KV tile (tests use small
    tiles to exercise the loop).  ``window`` > 0: a sliding-window layer, each
    query attends to the last ``window`` positions only (keys ``seq_len - window
    .. seq_len - 1``; transformers' ``sliding_window``); 0: the whole context.
    """
    _check_cache(key_cache, value_cache)
    _check_q(q, key_cache)
    num_seqs, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    cache_head_dim = _cache_head_dim(key_cache)
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.shape[0] < num_seqs or seq_lens.shape[0] < num_seqs:
        raise ValueError("block_tables/seq_lens have fewer rows than q")
    group = num_heads // num_kv_heads
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim, got {tuple(out.shape)}")
    if num_seqs == 0:
        return out

    max_context = block_tables.shape[1] * block_size
    if block_n is None:
        block_n = 64 if q.device.type == "cuda" else 32
    block_n = max(16, triton.next_power_of_2(block_n))
    if num_splits is None:
        num_splits = default_num_splits(num_seqs, num_kv_heads, max_context, q.device)
    num_splits = max(1, int(num_splits))
    tokens_per_split = triton.cdiv(triton.cdiv(max_context, num_splits), block_n) * block_n
    num_splits = max(1, triton.cdiv(max_context, tokens_per_split))
    direct = num_splits == 1

    if direct:
        po = out  # unused placeholders
        plse = out
        po_strides = (0, 0, 0)
        plse_strides = (0, 0)
    else:
        po = torch.empty((num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
        plse = torch.empty((num_seqs, num_heads, num_splits), dtype=torch.float32, device=q.device)
        po_strides = po.stride()[:3]
        plse_strides = plse.stride()[:2]

    block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16 on the GPU; lanes masked
    block_h = max(16, triton.next_power_of_2(group))
    with _device_ctx(q):
        _decode_split_kernel[(num_seqs, num_kv_heads, num_splits)](
            q,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            out,
            po,
            plse,
            float(scale) * _LOG2E,
            *_paged_strides(q, key_cache, value_cache, block_tables, out),
            *po_strides,
            *plse_strides,
            block_size,
            tokens_per_split,
            int(window),
            GROUP=group,
            HEAD_DIM=head_dim,
            BLOCK_H=block_h,
            BLOCK_D=block_d,
            BLOCK_N=block_n,
            DIRECT=direct,
            UPCAST=_upcast_for_dot(q.dtype),
            KV_QUANT=_kv_quant(key_cache),
            num_warps=4,
            num_stages=2,
        )
        if not direct:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                out,
                po,
                plse,
                num_splits,
                out.stride(0),
                out.stride(1),
                *po_strides,
                *plse_strides,
                HEAD_DIM=head_dim,
                BLOCK_D=block_d,
                BLOCK_S=triton.next_power_of_2(num_splits),
                num_warps=1 if head_dim <= 64 else 2,
            )
    return out


# ---------------------------------------------------------------------------
# 3. paged prefill attention (chunked prefill, FlashAttention-2 style)
# ---------------------------------------------------------------------------


@triton.jit
def _prefill_kernel(
    q_ptr,
    kc_ptr,
    vc_ptr,
    bt_ptr,
    seq_lens_ptr,
    qsl_ptr,
    out_ptr,
    num_seqs,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kcb,
    stride_kcs,
    stride_kch,
    stride_vcb,
    stride_vcs,
    stride_vch,
    stride_bt,
    stride_ot,
    stride_oh,
    block_size,
    window,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    # Query blocks are laid out per sequence: sequence i owns program ids
    # [qsl[i] // BLOCK_M + i, qsl[i+1] // BLOCK_M + i + 1), a range at least
    # cdiv(q_len_i, BLOCK_M) long, so the grid needs num_tokens // BLOCK_M +
    # num_seqs programs and no host-side knowledge of the chunk lengths.
    pid = tl.program_id(0)
    head = tl.program_id(1)

    # Binary search: the last sequence whose first program id is <= pid.
    lo = 0
    hi = num_seqs - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        first = tl.load(qsl_ptr + mid) // BLOCK_M + mid
        if first <= pid:
            lo = mid
        else:
            hi = mid - 1
    seq = lo

    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    qb = pid - (q_start // BLOCK_M + seq)
    if qb * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix = seq_len - q_len
    kvh = head // GROUP

    offs_m = qb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)

    q = tl.load(
        q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys up to the last query position of this block (causal), clipped to
    # the context.  Every row sees key 0, so the running max is finite after
    # the first tile.
    kv_end = tl.minimum(seq_len, prefix + (qb + 1) * BLOCK_M)
    # Sliding window (window > 0): a row at position p sees keys p - window + 1 .. p. Tiles before the
    # block's first row's first key are skipped; a row whose window starts after a tile sees no key
    # there (its running max stays -inf: m_safe keeps exp2 off -inf - -inf).
    win = tl.where(window > 0, window, seq_len + 1)
    kv_start = tl.maximum(prefix + qb * BLOCK_M - win + 1, 0) // BLOCK_N * BLOCK_N
    bt_row = bt_ptr + seq.to(tl.int64) * stride_bt
    for n0 in range(kv_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_kv_tile(
            q, m_i, l_i, acc, kc_ptr, vc_ptr, bt_row, kvh, n0, 0, kv_end, q_pos, win, offs_d, d_mask, scale_log2,
            block_size,
            stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
            BLOCK_N=BLOCK_N, CAUSAL=True, UPCAST=UPCAST, KV_QUANT=KV_QUANT, HEAD_DIM=HEAD_DIM,
        )

    o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill_attention(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    window: int = 0,
) -> torch.Tensor:
    """Causal attention for a packed batch of query chunks over the paged cache.

    ``q`` ``[num_tokens, num_heads, head_dim]``; sequence ``i``'s queries are
    rows ``query_start_loc[i]:query_start_loc[i+1]`` at positions
    ``seq_lens[i] - q_len_i ... seq_lens[i] - 1``.  Keys/values (cached prefix
    and this chunk) are all read from the cache, so call
    :func:`reshape_and_cache` first.  Works for decode rows too (``q_len = 1``).
    Rows of ``q`` not covered by ``query_start_loc`` are left unwritten.
    ``window`` > 0: a sliding-window layer (a query at position ``p`` attends to
    keys ``p - window + 1 .. p``, transformers' ``sliding_window``); 0: causal
    over the whole context.
    """
    _check_cache(key_cache, value_cache)
    _check_q(q, key_cache)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = key_cache.shape
    cache_head_dim = _cache_head_dim(key_cache)
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = query_start_loc.shape[0] - 1
    if block_tables.shape[0] < num_seqs or seq_lens.shape[0] < num_seqs:
        raise ValueError("block_tables/seq_lens have fewer rows than query_start_loc describes")
    q = _last_dim_contiguous(q)
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous last dim, got {tuple(out.shape)}")
    if num_tokens == 0 or num_seqs <= 0:
        return out

    on_gpu = q.device.type == "cuda"
    if block_m is None:
        block_m = 64 if on_gpu else 32
    if block_n is None:
        block_n = (64 if head_dim <= 128 else 32) if on_gpu else 32
    block_m = max(16, triton.next_power_of_2(block_m))
    block_n = max(16, triton.next_power_of_2(block_n))
    grid = (num_tokens // block_m + num_seqs, num_heads)
    with _device_ctx(q):
        _prefill_kernel[grid](
            q,
            key_cache,
            value_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            out,
            num_seqs,
            float(scale) * _LOG2E,
            *_paged_strides(q, key_cache, value_cache, block_tables, out),
            block_size,
            int(window),
            GROUP=num_heads // num_kv_heads,
            HEAD_DIM=head_dim,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_D=max(16, triton.next_power_of_2(head_dim)),  # tl.dot needs >= 16; lanes masked
            UPCAST=_upcast_for_dot(q.dtype),
            KV_QUANT=_kv_quant(key_cache),
            num_warps=4,
            num_stages=2,
        )
    return out
