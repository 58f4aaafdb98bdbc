"""Quantized KV cache formats (``--kv-cache-dtype int8|fp8``): the storage layout, and the reference
quantize / dequantize that the PyTorch backend runs and the C++ kernels match bit for bit.

Layout. A quantized layer cache is one tensor ``[2, num_blocks, block_size, Hk, D + 2]`` of one-byte
elements (``torch.int8`` for ``int8``, ``torch.uint8`` for ``fp8``): each (token, KV head) row
holds its D quantized values followed by its own scale, a bfloat16 in the last two bytes (``fp8`` is
stored as ``torch.uint8``, the e4m3 bits: PyTorch has no CPU ``index_copy`` for float8 tensors, and
every block copy is a byte copy anyway). The scale
travels inside the block, so every path that copies blocks (the prefix cache, the offload tier and its
disk file, swap preemption) carries it without knowing about it.

Granularity: one scale per (token, KV head), not per (block, KV head). A block is written a few tokens
at a time (decode appends one); a per-block scale would change as later tokens arrive, and either the
earlier tokens would be requantized (a row's K/V then depends on tokens after it: the prefix cache,
chunking and batching would change outputs) or the first tokens would fix a scale too small for the
rest. A per-token scale depends only on the token itself, so the invariance of the bf16 cache holds.
Cost: 2 bytes per D values (3 % of an int8 row at D = 64): a block holds 2D / (D + 2) = 1.94x the
tokens of a bf16 block at D = 64, 1.97x at D = 128.

Quantization of a row x (already rounded to the model dtype, i.e. exactly what the bf16 cache would
store):
  * int8: s = bf16(max|x| / 127), q = clamp(round_half_even(x / s), -127, 127) (symmetric, as
    llama.cpp's ``q8_0`` blocks of 32 and vLLM's per-token int8 KV); 0 where s == 0;
  * fp8 (e4m3, vLLM's ``fp8`` / ``fp8_e4m3``): s = bf16(max|x| / 448), q = e4m3(clamp(x / s, ±448))
    rounded to nearest even (vLLM scales per tensor, by default 1.0; a per-row scale keeps the small
    heads out of e4m3's subnormals).
Dequantization: x' = float(q) * float(s), exact in float32 (at most 8 x 8 significant bits).

K smoothing (SageAttention's per-channel mean subtraction) is not applied: the mean would be over the
context's tokens, which breaks the per-token rule above (see docs/kv-cache-dtype.md).
"""

from __future__ import annotations

import torch

# --kv-cache-dtype values (vLLM's names; int8 is tinyvllm's) -> the canonical name.
KV_CACHE_DTYPES = {"auto": "auto", "bfloat16": "bfloat16", "int8": "int8",
                   "fp8": "fp8", "fp8_e4m3": "fp8"}
QUANTIZED = ("int8", "fp8")
SCALE_BYTES = 2  # one bfloat16 scale per (token, KV head) row
_QMAX = {"int8": 127.0, "fp8": 448.0}
_STORAGE = {"int8": torch.int8, "fp8": torch.uint8}


def canonical_kv_cache_dtype(name: str) -> str:
    """The canonical ``--kv-cache-dtype`` (``fp8_e4m3`` -> ``fp8``).

    Raises:
        ValueError: an unknown value (``fp8_e5m2`` included: not supported), naming the flag.
    """
    key = str(name).lower()
    if key not in KV_CACHE_DTYPES:
        extra = " (fp8 here is e4m3; e5m2 is not supported)" if key.startswith("fp8") else ""
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {name!r}{extra}")
    return KV_CACHE_DTYPES[key]


def kv_storage(kv_cache_dtype: str, model_dtype: torch.dtype) -> tuple[torch.dtype, int]:
    """``(element dtype, extra elements per row)`` of the cache for a canonical ``kv_cache_dtype``
    (``auto``/``bfloat16``: the model dtype, 0 extra; ``int8``/``fp8``: one byte per value
    plus :data:`SCALE_BYTES`)."""
    if kv_cache_dtype in QUANTIZED:
        return _STORAGE[kv_cache_dtype], SCALE_BYTES
    return model_dtype, 0


def kv_bytes_per_token(kv_cache_dtype: str, model_dtype: torch.dtype, num_layers: int, num_kv_heads: int,
                       head_dim: int) -> int:
    """Bytes of K and V of one token over all layers (the scales included)."""
    elem, extra = kv_storage(kv_cache_dtype, model_dtype)
    return 2 * num_layers * num_kv_heads * (head_dim + extra) * torch.empty((), dtype=elem).element_size()


def quantization_of(kv_cache: torch.Tensor) -> str | None:
    """``int8``/``fp8`` for a quantized cache tensor (by its element dtype), else ``None``."""
    for name, dt in _STORAGE.items():
        if kv_cache.dtype == dt:
            return name
    return None


def quantize(x: torch.Tensor, kind: str, model_dtype: torch.dtype) -> torch.Tensor:
    """Quantize rows ``x`` [..., D] (any float dtype; first rounded to ``model_dtype``) to ``[..., D + 2]``
    of the storage dtype of ``kind`` (``int8``/``fp8``): the values, then the row's bfloat16 scale."""
    xf = x.to(model_dtype).float()
    amax = xf.abs().amax(dim=-1, keepdim=True)
    s = (amax / _QMAX[kind]).to(torch.bfloat16)
    sf = s.float()
    ok = sf > 0
    r = xf / torch.where(ok, sf, torch.ones_like(sf))
    if kind == "int8":
        qv = torch.where(ok, r.round().clamp(-127, 127), torch.zeros_like(r)).to(torch.int8)
    else:
        qv = torch.where(ok, r.clamp(-448, 448), torch.zeros_like(r)).to(torch.float8_e4m3fn).view(torch.uint8)
    scale_bytes = s.view(_STORAGE[kind])  # [..., 2]: the bfloat16's two bytes
    return torch.cat([qv, scale_bytes], dim=-1)


def dequantize(rows: torch.Tensor) -> torch.Tensor:
    """Quantized rows ``[..., D + 2]`` -> float32 ``[..., D]`` (``float(q) * float(scale)``, exact)."""
    d = rows.shape[-1] - SCALE_BYTES
    s = rows[..., d:].contiguous().view(torch.bfloat16).float()  # [..., 1]
    q = rows[..., :d]
    if q.dtype == torch.uint8:
        q = q.view(torch.float8_e4m3fn)
    return q.float() * s


def quantize_query(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The query quantization of the C++ int8 Q K^T kernel (``kernels/cpu/attention_int8.h``), in PyTorch
    ops: per (token, query head) row of ``q`` ``[..., D]`` float32, symmetric int8 as SageAttention
    quantizes Q per block (Zhang et al., ICLR 2025): ``qs = max|q| / 127`` and ``q8 =
    round_half_even(q * (127 / max|q|))`` (float32 arithmetic; all zeros where ``max|q| == 0``).

    Returns ``(q8 [..., D] int8, qs [..., 1] float32)``; ``q ≈ q8 * qs``. The scores are then
    ``(q8 · k8) * qs * s_k`` with the int32 dot product exact.
    """
    qf = q.float()
    amax = qf.abs().amax(dim=-1, keepdim=True)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    q8 = (qf * inv).round().clamp(-128, 127).to(torch.int8)
    return q8, amax / 127.0
