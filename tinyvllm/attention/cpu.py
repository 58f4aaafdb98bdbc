"""The C++ CPU backend (:mod:`tinyvllm.kernels.cpu`): per layer, ``rms_norm`` (+ residual),
``rope_cache_attention`` (RoPE on q/k, KV-cache write and paged attention in one call, reading the
context in place through the block table) and ``silu_and_mul``; linear weights packed for the
batch-invariant bf16 GEMM (``cpu_gemm.cpp``) when the CPU has AVX512-BF16.

Every query row is computed by the same fixed-order operations over its own context, so greedy
outputs are batch invariant (see DESIGN.md). For bfloat16 and float32 models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tinyvllm.attention.base import AttentionBackend, paged_slots


@dataclass
class CpuAttentionMetadata:
    """Per-step inputs of the C++ kernels.

    Attributes:
        slot_mapping: [T] int64 cache slot of each new token.
        block_tables: [S, max_blocks] int64 physical block ids (0-padded).
        token_seq: [T] int64 sequence index of each new token.
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    token_seq: torch.Tensor


@dataclass
class CpuRopeInputs:
    """cos and sin tables [>= max position + 1, D/2] float32 and the positions [T] int64."""

    cos: torch.Tensor
    sin: torch.Tensor
    positions: torch.Tensor


class CpuAttentionBackend(AttentionBackend):
    """The C++ kernels, for bfloat16/float32 models on the CPU."""

    name = "cpu"

    def __init__(self, kernels: Any, device: torch.device | str = "cpu") -> None:
        super().__init__(device)
        self.kernels = kernels
        self.cpu_gemm = kernels if kernels.gemm_has_bf16_kernel() else None  # the portable GEMM loop is slower than oneDNN
        # The kernels' own entry points, bound once: the model calls them with no Python frame in between.
        self.rms_norm = kernels.rms_norm  # type: ignore[method-assign]
        self.silu_and_mul = kernels.silu_and_mul  # type: ignore[method-assign]
        self._rope_cache_attention = kernels.rope_cache_attention

    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> CpuAttentionMetadata:
        _, bt, _, slot_mapping = paged_slots(query_lens, seq_lens, block_tables, block_size)
        token_seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens, dtype=torch.int64))
        return CpuAttentionMetadata(slot_mapping.to(self.device), bt.to(self.device), token_seq.to(self.device))

    def rope_inputs(self, rotary: Any, positions: torch.Tensor) -> CpuRopeInputs:
        needed = int(positions.max().item()) + 1 if positions.numel() else 1
        cos, sin = rotary.tables(needed)
        return CpuRopeInputs(cos, sin, positions)

    def attention(self, qkv: torch.Tensor, kv_cache: torch.Tensor, md: CpuAttentionMetadata, rope: CpuRopeInputs,
                  num_heads: int, num_kv_heads: int, head_dim: int, scale: float, window: int = 0) -> torch.Tensor:
        return self._rope_cache_attention(qkv, rope.cos, rope.sin, rope.positions, kv_cache, md.slot_mapping,
                                          md.block_tables, md.token_seq, num_heads, num_kv_heads, scale, window)

    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:  # replaced by the kernel in __init__
        return self.kernels.rms_norm(x, residual, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:  # replaced by the kernel in __init__
        return self.kernels.silu_and_mul(x)
