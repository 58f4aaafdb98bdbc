"""The Triton backend (:mod:`tinyvllm.kernels.triton`): always on CUDA; on the CPU only with
``TINYVLLM_ATTENTION=triton`` under ``TRITON_INTERPRET=1`` (for tests).

Per layer: the fused Triton RMSNorm (+ residual add); RoPE in place on the q and k slices of the
fused qkv output; :func:`~tinyvllm.kernels.triton.attention.reshape_and_cache` writes this step's K/V
rows into their slots (slot ``-1`` rows are skipped: CUDA-graph padding); a decode-only batch (every
sequence has one new token, so token ``i`` is sequence ``i``) runs
:func:`~tinyvllm.kernels.triton.attention.paged_decode_attention` (split-K flash-decoding), anything
else - prefill chunks, mixed steps - runs :func:`~tinyvllm.kernels.triton.attention.paged_prefill_attention`,
which attends over each sequence's cached prefix and causally within its chunk; ``F.silu``.

An int8/fp8 cache (``--kv-cache-dtype``, :mod:`tinyvllm.attention.kv_quant`): this step's K/V rows are
quantized with ``kv_quant.quantize`` (the bytes the CPU backends store) and copied by
``reshape_and_cache``; the attention kernels dequantize in registers.

Both attention kernels read the context only through the block table, so prefix-cached blocks and
chunked prefill need nothing special. Nothing here reads device values on the host (on CUDA), so a
decode step can be captured in a CUDA graph. ``triton`` is imported when the backend is built, never
when tinyvllm is imported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tinyvllm.attention import kv_quant
from tinyvllm.attention.base import AttentionBackend, paged_slots
from tinyvllm.attention.torch_ref import silu_and_mul


@dataclass
class TritonAttentionMetadata:
    """Per-step inputs of the Triton kernels, all on the backend's device (the CUDA-graph runner passes
    views of its static buffers).

    Attributes:
        slot_mapping: [T] int64 cache slot of each new token (``-1``: store nothing).
        block_tables: [S, max_blocks] int64 physical block ids (0-padded).
        seq_lens: [S] int32 context lengths incl. this step's tokens.
        query_start_loc: [S + 1] int32 cumulative new-token counts.
        decode_only: every sequence has exactly one new token.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    decode_only: bool


class TritonAttentionBackend(AttentionBackend):
    """The Triton kernels, on CUDA (or interpreted on the CPU).

    Raises:
        RuntimeError: a CPU device while the kernels are compiled (not interpreted).
    """

    name = "triton"

    def __init__(self, device: torch.device | str) -> None:
        super().__init__(device)
        # Modules, not functions: attributes are read at call time, so a test's ``importlib.reload``
        # (interpreter vs compiled) or monkeypatch of a kernel is seen.
        from tinyvllm.kernels.triton import attention as tk  # imports triton: here, not at module import
        from tinyvllm.kernels.triton import ops

        self._tk, self._ops = tk, ops
        if self.device.type != "cuda" and not self._tk._interpreting():
            raise RuntimeError("the Triton attention backend got a CPU device but its kernels are compiled for "
                               "the GPU; set TRITON_INTERPRET=1 before triton is imported to run them on the CPU")
        # On CUDA the rotary table covers max_position, so no step reads positions back (CUDA-graph capture).
        self._full_rope_table = self.device.type == "cuda"

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> TritonAttentionMetadata:
        qsl, bt, _, slot_mapping = paged_slots(query_lens, seq_lens, block_tables, block_size)
        dev = self.device
        return TritonAttentionMetadata(slot_mapping.to(dev), bt.to(dev),
                                       torch.tensor(seq_lens, dtype=torch.int32).to(dev),
                                       torch.tensor(qsl, dtype=torch.int32).to(dev),
                                       all(q == 1 for q in query_lens))

    def rope_inputs(self, rotary: Any, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, cos_sin_cache [n, D] float32): the fused rotary kernel's inputs."""
        needed = rotary.max_position if self._full_rope_table else (
            int(positions.max().item()) + 1 if positions.numel() else 1)
        return positions, rotary.cos_sin_cache(needed)

    def attention(self, qkv: torch.Tensor, kv_cache: torch.Tensor, md: TritonAttentionMetadata,
                  rope: tuple[torch.Tensor, torch.Tensor], num_heads: int, num_kv_heads: int, head_dim: int,
                  scale: float, window: int = 0) -> torch.Tensor:
        T = qkv.shape[0]
        qkv = qkv.view(T, num_heads + 2 * num_kv_heads, head_dim)
        q, k = qkv[:, :num_heads], qkv[:, num_heads: num_heads + num_kv_heads]
        v = qkv[:, num_heads + num_kv_heads:]
        positions, cos_sin_cache = rope
        self._ops.rotary_embedding(positions, q, k, cos_sin_cache)  # in place on the qkv output
        tk = self._tk
        key_cache, value_cache = kv_cache[0], kv_cache[1]
        kind = kv_quant.quantization_of(kv_cache)
        if kind is not None:  # int8/fp8 cache: rows quantized here (PyTorch ops, no host sync), stored as bytes
            k, v = kv_quant.quantize(k, kind, k.dtype), kv_quant.quantize(v, kind, v.dtype)
        tk.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping)
        if md.decode_only:
            o = tk.paged_decode_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens, scale,
                                          window=window)
        else:
            o = tk.paged_prefill_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens,
                                           md.query_start_loc, scale, window=window)
        return o.reshape(T, num_heads * head_dim)

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        # Without a residual the kernel returns ``x`` itself as the new residual stream.
        return self._ops.rms_norm(x, weight, eps, residual)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)
