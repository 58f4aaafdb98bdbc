"""Fused Triton element-wise ops for the GPU path: RMSNorm (+ residual add)
and rotary position embedding (rotate-half / GPT-NeoX / HF Llama layout).

Like :mod:`tinyvllm.kernels.triton.attention` these launch on whatever device
the tensors are on; CPU tensors work under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

__all__ = ["rms_norm", "rotary_embedding"]


def _device_ctx(t: torch.Tensor):
    if t.device.type == "cuda":
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def _rows(x: torch.Tensor) -> torch.Tensor:
    """View ``x`` as [rows, hidden] with a contiguous last dim (copy if needed)."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if x.dim() == 2:
        return x
    try:
        return x.view(-1, x.shape[-1])
    except RuntimeError:
        return x.reshape(-1, x.shape[-1])


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    stride_x,
    stride_r,
    stride_o,
    stride_nr,
    n_cols,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n_cols
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
        # The sum is rounded to the activation dtype (as ``residual + x`` is in
        # the reference model) and the norm is taken of the rounded value.
        s = (x + r).to(new_res_ptr.dtype.element_ty)
        tl.store(new_res_ptr + row * stride_nr + offs, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = x * tl.rsqrt(var + eps)
    # HF LlamaRMSNorm: weight * normed.to(input_dtype)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fused (residual add +) RMSNorm over the last dim.

    Returns ``(out, new_residual)``.  With ``residual``: ``new_residual = x +
    residual`` (rounded to ``x.dtype``) and ``out = rmsnorm(new_residual) *
    weight``.  Without: ``out = rmsnorm(x) * weight`` and ``new_residual`` is
    ``x`` itself (the residual stream for the next add).  Math is float32;
    ``out`` has ``x``'s dtype and shape.  Inputs are not modified.
    """
    hidden = x.shape[-1]
    if weight.shape != (hidden,):
        raise ValueError(f"weight shape {tuple(weight.shape)} != ({hidden},)")
    if residual is not None and residual.shape != x.shape:
        raise ValueError(f"residual shape {tuple(residual.shape)} != x shape {tuple(x.shape)}")
    x2 = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out2 = out.view(-1, hidden)
    if residual is not None:
        r2 = _rows(residual)
        new_res = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        nr2 = new_res.view(-1, hidden)
    else:
        r2 = x2
        new_res = x
        nr2 = out2  # unused
    n_rows = x2.shape[0]
    if n_rows == 0:
        return out, new_res
    block = triton.next_power_of_2(hidden)
    num_warps = 1 if block <= 256 else 4 if block <= 2048 else 8 if block <= 8192 else 16
    with _device_ctx(x):
        _rms_norm_kernel[(n_rows,)](
            x2,
            r2,
            weight,
            out2,
            nr2,
            x2.stride(0),
            r2.stride(0),
            out2.stride(0),
            nr2.stride(0),
            hidden,
            float(eps),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            num_warps=num_warps,
        )
    return out, new_res


# ---------------------------------------------------------------------------
# Rotary embedding
# ---------------------------------------------------------------------------


@triton.jit
def _rope_rotate(
    x_ptr,
    t,
    stride_t,
    stride_h,
    cos,
    sin,
    offs_r,
    r_mask,
    NUM_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    offs_h = tl.arange(0, BLOCK_H)
    mask = (offs_h < NUM_HEADS)[:, None] & r_mask[None, :]
    p1 = x_ptr + t * stride_t + offs_h[:, None] * stride_h + offs_r[None, :]
    p2 = p1 + HALF
    x1 = tl.load(p1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(p2, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(p1, o1.to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(p2, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rope_kernel(
    pos_ptr,
    q_ptr,
    k_ptr,
    cs_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cs,
    NUM_Q_HEADS: tl.constexpr,
    NUM_K_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    BLOCK_HQ: tl.constexpr,
    BLOCK_HK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    HAS_K: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < HALF
    cos = tl.load(cs_ptr + pos * stride_cs + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    sin = tl.load(cs_ptr + pos * stride_cs + HALF + offs_r, mask=r_mask, other=0.0).to(tl.float32)
    _rope_rotate(q_ptr, t, stride_qt, stride_qh, cos, sin, offs_r, r_mask, NUM_Q_HEADS, HALF, BLOCK_HQ)
    if HAS_K:
        _rope_rotate(k_ptr, t, stride_kt, stride_kh, cos, sin, offs_r, r_mask, NUM_K_HEADS, HALF, BLOCK_HK)


def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor | None,
    cos_sin_cache: torch.Tensor,
) -> None:
    """Apply rotate-half RoPE to ``q`` ``[num_tokens, num_heads, head_dim]`` and
    ``k`` ``[num_tokens, num_kv_heads, head_dim]`` in place.

    ``cos_sin_cache`` is ``[max_position, rot_dim]``: ``cos`` in the first
    ``rot_dim/2`` columns, ``sin`` in the rest (any RoPE scaling, e.g. llama3,
    is baked in by whoever builds it).  The first ``rot_dim`` (<= head_dim)
    channels are rotated as ``x1*cos - x2*sin, x2*cos + x1*sin`` with ``x1, x2``
    the two halves; the rest are left alone.  Math is float32, rounded once.
    ``positions`` ``[num_tokens]`` (any integer dtype).  ``q``/``k`` may be
    strided views (e.g. slices of a fused qkv output) but their last dim must
    be contiguous.
    """
    if q.dim() != 3 or (k is not None and k.dim() != 3):
        raise ValueError("q and k must be [num_tokens, heads, head_dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    rot_dim = cos_sin_cache.shape[-1]
    if rot_dim % 2 or rot_dim > head_dim:
        raise ValueError(f"cos_sin_cache width {rot_dim} must be even and <= head_dim {head_dim}")
    if q.stride(-1) != 1 or (k is not None and k.stride(-1) != 1):
        raise ValueError("rotary_embedding works in place: q/k need a contiguous last dim")
    if cos_sin_cache.stride(-1) != 1:
        cos_sin_cache = cos_sin_cache.contiguous()
    if positions.shape[0] < num_tokens:
        raise ValueError("positions is shorter than q")
    if k is not None and (k.shape[0] != num_tokens or k.shape[2] != head_dim):
        raise ValueError(f"k shape {tuple(k.shape)} does not match q {tuple(q.shape)}")
    if num_tokens == 0:
        return
    num_k_heads = k.shape[1] if k is not None else 1
    half = rot_dim // 2
    kk = k if k is not None else q
    with _device_ctx(q):
        _rope_kernel[(num_tokens,)](
            positions,
            q,
            kk,
            cos_sin_cache,
            q.stride(0),
            q.stride(1),
            kk.stride(0),
            kk.stride(1),
            cos_sin_cache.stride(0),
            NUM_Q_HEADS=num_q_heads,
            NUM_K_HEADS=num_k_heads,
            HALF=half,
            BLOCK_HQ=triton.next_power_of_2(num_q_heads),
            BLOCK_HK=triton.next_power_of_2(num_k_heads),
            BLOCK_R=triton.next_power_of_2(half),
            HAS_K=k is not None,
            num_warps=1 if num_q_heads * half <= 512 else 4,
        )
