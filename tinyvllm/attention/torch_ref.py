"""The pure-PyTorch reference backend (``TINYVLLM_ATTENTION=torch``, or when the C++ kernels cannot be
built): attention in float64 over gathered K/V, HF-style RMSNorm in float32, rotate-half RoPE,
``F.silu``. No C++ at all (and so no weight packing).

Exactness: the score, softmax and value reductions run in float64 and are rounded once to the model
dtype. Their float64 summation order may depend on the shapes of the batch, but the error that leaves
is ~1e-16 relative, far below one bfloat16/float32 ulp, so a query row's output does not depend on
what else is in the batch, on how its prompt was chunked, or on whether its prefix came from the
cache — greedy outputs are batch invariant (see DESIGN.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from tinyvllm.attention.base import AttentionBackend, paged_slots
from tinyvllm.attention import kv_quant


@dataclass
class TorchAttentionMetadata:
    """Per-step inputs of the reference attention.

    Attributes:
        slot_mapping: [T] int64 cache slot of each new token.
        query_start_loc: [S + 1] python ints (cumulative new-token counts).
        seq_lens: [S] python ints, context length incl. this step's tokens.
        decode_seq_ids: python ints of the sequences with exactly one new token (batched together):
            ``decode_token_idx`` [Sd] int64 their token's index, ``decode_slots`` [Sd, Lmax] int64 the slots
            of every context position, ``decode_mask`` [Sd, Lmax] bool (True = attend).
        prefill_seq_ids: python ints of the sequences with more than one new token, and per such
            sequence ``prefill_slots`` [seq_len] int64 the slots of its context.
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    decode_seq_ids: list[int]
    decode_token_idx: torch.Tensor
    decode_slots: torch.Tensor
    decode_mask: torch.Tensor
    prefill_seq_ids: list[int]
    prefill_slots: list[torch.Tensor]


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hk, D] into ``kv_cache`` [2, num_blocks, block_size, Hk, D] at ``slot_mapping`` [T].
    An int8/fp8 cache ([..., D + 2]) gets the rows quantized from their own dtype (kv_quant.quantize)."""
    hk, d = kv_cache.shape[-2], kv_cache.shape[-1]
    kind = kv_quant.quantization_of(kv_cache)
    if kind is not None:
        k, v = kv_quant.quantize(k, kind, k.dtype), kv_quant.quantize(v, kind, v.dtype)
    kv_cache[0].view(-1, hk, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, hk, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _rows(cache: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """``cache[idx]`` of a ``[slots, Hk, D(+2)]`` cache view, dequantized to float32 if it is int8/fp8."""
    r = cache[idx]
    return r if kv_quant.quantization_of(cache) is None else kv_quant.dequantize(r)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention in float64.

    Args:
        q: [S, Q, Hk, G, D] queries (G = query heads per KV head).
        k, v: [S, L, Hk, D] keys and values.
        mask: [S, Q, L] bool, True where query may attend to key.
    Returns:
        [S, Q, Hk, G, D] float64.
    """
    qd = q.double()
    kd = k.double()
    vd = v.double()
    scores = torch.einsum("sqhgd,slhd->shgql", qd, kd) * scale
    scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("shgql,slhd->sqhgd", probs, vd)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: TorchAttentionMetadata, scale: float, window: int = 0) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over each sequence's context.

    Args:
        q: [T, Hq, D] queries of the packed batch.
        k, v: [T, Hk, D] new keys and values.
        kv_cache: [2, num_blocks, block_size, Hk, D] this layer's cache.
        scale: softmax scale (usually D ** -0.5).
        window: > 0: sliding window, a query at position p attends to keys p - window + 1 .. p only.
    Returns:
        [T, Hq, D] attention output, dtype of ``q``.
    """
    T, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    write_kv(kv_cache, k, v, md.slot_mapping)
    kc = kv_cache[0].view(-1, hk, kv_cache.shape[-1])
    vc = kv_cache[1].view(-1, hk, kv_cache.shape[-1])
    out = torch.empty(T, hq, d, dtype=q.dtype, device=q.device)
    if md.decode_seq_ids:
        qd = q.index_select(0, md.decode_token_idx).reshape(-1, 1, hk, g, d)
        kd = _rows(kc, md.decode_slots)  # [Sd, L, Hk, D]
        vd = _rows(vc, md.decode_slots)
        mask = md.decode_mask
        if window > 0:
            lens = torch.tensor([md.seq_lens[i] for i in md.decode_seq_ids], device=mask.device)
            mask = mask & (torch.arange(mask.shape[1], device=mask.device)[None, :] >= lens[:, None] - window)
        o = _attend(qd, kd, vd, mask[:, None, :], scale)
        out.index_copy_(0, md.decode_token_idx, o.reshape(-1, hq, d).to(q.dtype))
    for j, i in enumerate(md.prefill_seq_ids):
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        ql, sl = end - start, md.seq_lens[i]
        slots = md.prefill_slots[j]
        kp = _rows(kc, slots)[None]
        vp = _rows(vc, slots)[None]
        qpos = torch.arange(sl - ql, sl, device=q.device)
        kpos = torch.arange(sl, device=q.device)[None, :]
        mask = kpos <= qpos[:, None]
        if window > 0:
            mask = mask & (kpos > qpos[:, None] - window)
        mask = mask[None]
        o = _attend(q[start:end].reshape(1, ql, hk, g, d), kp, vp, mask, scale)
        out[start:end] = o.reshape(ql, hq, d).to(q.dtype)
    return out


def rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm (Zhang & Sennrich 2019) as Hugging Face's ``LlamaRMSNorm``: normalise in float32, cast
    back, then scale. With ``residual``, first ``x = x + residual`` (in the model dtype).
    Returns ``(normed, x)``."""
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    h = x.to(torch.float32)
    var = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(var + eps)
    return weight * h.to(dtype), x


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` [T, H, D] (rotate-half layout) by ``cos``/``sin`` [T, 1, D/2]; math in float32."""
    dtype = x.dtype
    xf = x.float()
    half = xf.shape[-1] // 2
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``x`` = [gate | up] [T, 2I]."""
    inter = x.shape[-1] // 2
    gate, up = x.split([inter, inter], dim=-1)
    return F.silu(gate) * up


class TorchAttentionBackend(AttentionBackend):
    """The PyTorch float64 reference, on the CPU (any dtype)."""

    name = "torch"

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> TorchAttentionMetadata:
        qsl, _, all_slots, slot_mapping = paged_slots(query_lens, seq_lens, block_tables, block_size)
        dec = [i for i, q in enumerate(query_lens) if q == 1]
        pre = [i for i, q in enumerate(query_lens) if q > 1]
        if dec:
            lmax = max(seq_lens[i] for i in dec)
            idx = torch.tensor(dec, dtype=torch.int64)
            decode_slots = all_slots[idx, :lmax].clone()
            lens = torch.tensor([seq_lens[i] for i in dec], dtype=torch.int64)
            decode_mask = torch.arange(lmax)[None, :] < lens[:, None]
            decode_slots[~decode_mask] = 0
            decode_token_idx = torch.tensor([qsl[i] for i in dec], dtype=torch.int64)
        else:
            decode_slots = torch.zeros(0, 1, dtype=torch.int64)
            decode_mask = torch.zeros(0, 1, dtype=torch.bool)
            decode_token_idx = torch.zeros(0, dtype=torch.int64)
        dev = self.device
        return TorchAttentionMetadata(
            slot_mapping=slot_mapping.to(dev), query_start_loc=qsl, seq_lens=list(seq_lens),
            decode_seq_ids=dec, decode_token_idx=decode_token_idx.to(dev), decode_slots=decode_slots.to(dev),
            decode_mask=decode_mask.to(dev), prefill_seq_ids=pre,
            prefill_slots=[all_slots[i, : seq_lens[i]].clone().to(dev) for i in pre],
        )

    def rope_inputs(self, rotary: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at each token's position: [T, 1, D/2] float32 each."""
        needed = int(positions.max().item()) + 1 if positions.numel() else 1
        cos, sin = rotary.tables(needed)
        return cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)

    def attention(self, qkv: torch.Tensor, kv_cache: torch.Tensor, md: TorchAttentionMetadata,
                  rope: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int,
                  scale: float, window: int = 0) -> torch.Tensor:
        T = qkv.shape[0]
        q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = q.reshape(T, num_heads, head_dim)
        k = k.reshape(T, num_kv_heads, head_dim)
        v = v.reshape(T, num_kv_heads, head_dim)
        cos, sin = rope
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        return paged_attention(q, k, v, kv_cache, md, scale, window).reshape(T, q_size)

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        return rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
