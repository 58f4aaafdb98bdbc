"""The attention-backend interface: what the model calls once per layer, and the per-step metadata.

A backend is chosen once per engine (:func:`tinyvllm.attention.selector.get_attn_backend`) and bound
to the model (``LlamaForCausalLM.bind_attn_backend``), which then calls, per layer and with no other
dispatch: :meth:`AttentionBackend.rms_norm` (with the residual add), :meth:`AttentionBackend.attention`
(RoPE on q/k, KV-cache write and paged attention, from the fused qkv projection) and
:meth:`AttentionBackend.silu_and_mul`. The linear layers are the model's own.

Each backend has its own metadata dataclass, built from plain Python lists by
:meth:`AttentionBackend.build_metadata`. Sequences are packed in order: sequence ``i``'s new tokens
are ``tokens[query_start_loc[i]:query_start_loc[i+1]]`` and sit at positions
``seq_lens[i] - q_len_i ... seq_lens[i] - 1``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch


class AttentionBackend(ABC):
    """The per-layer ops of one kind of kernels, on one device.

    Attributes:
        name: ``cpu``, ``torch`` or ``triton`` (the values of ``TINYVLLM_ATTENTION``).
        device: where its tensors live.
        cpu_gemm: the C++ kernels module whose bf16 GEMM the model's linear weights should be packed
            for (``LlamaForCausalLM.pack_for_cpu``), or None: only the C++ backend packs.
    """

    name: ClassVar[str]
    cpu_gemm: Any = None

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(device={self.device})"

    @abstractmethod
    def build_metadata(self, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
                       block_size: int) -> Any:
        """This step's metadata (this backend's own dataclass, tensors on :attr:`device`).

        Args:
            query_lens: new tokens of each sequence.
            seq_lens: context length of each sequence, this step's tokens included.
            block_tables: physical block ids of each sequence, in logical order.
            block_size: tokens per block.

        Raises:
            ValueError: a block table too short for its sequence length.
        """

    @abstractmethod
    def rope_inputs(self, rotary: Any, positions: torch.Tensor) -> Any:
        """Per-step rotary inputs shared by all layers, from the model's ``RotaryEmbedding`` (its
        ``tables(n)`` / ``cos_sin_cache(n)`` / ``max_position``) and ``positions`` [T] int64."""

    @abstractmethod
    def attention(self, qkv: torch.Tensor, kv_cache: torch.Tensor, md: Any, rope: Any, num_heads: int,
                  num_kv_heads: int, head_dim: int, scale: float, window: int = 0) -> torch.Tensor:
        """RoPE on q and k, store this step's K/V, attend over each sequence's context.

        Args:
            qkv: [T, (Hq + 2 Hk) * D] output of the fused q/k/v projection (q, then k, then v).
            kv_cache: [2, num_blocks, block_size, Hk, D] this layer's cache.
            md: this backend's step metadata; rope: :meth:`rope_inputs` of this step.
            window: > 0 for a sliding-window layer: a query at position ``p`` attends to the keys at
                ``p - window + 1 .. p`` only (transformers' ``sliding_window``: ``kv_idx > q_idx -
                window``; Mistral, Gemma 3's local layers); 0: the whole causal context.
        Returns:
            [T, Hq * D] attention output, in the model dtype.
        """

    @abstractmethod
    def rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """RMSNorm with the fused residual add of a pre-norm transformer: with ``residual``,
        ``x = x + residual`` first; returns ``(normed(x), x)`` (``x`` is the new residual stream)."""

    @abstractmethod
    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        """SwiGLU's activation: ``x`` [T, 2I] = [gate | up] -> ``silu(gate) * up`` [T, I]."""


def paged_slots(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]], block_size: int
                ) -> tuple[list[int], torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layout every backend's metadata starts from, on the CPU.

    Returns:
        ``query_start_loc`` (python ints, [S + 1]); the block tables [S, max_blocks] int64 (0-padded);
        the slot of every context position of every sequence [S, max_blocks * block_size] int64;
        the slot mapping [T] int64 (the cache slot of each new token).

    Raises:
        ValueError: a block table too short for its sequence length.
    """
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    max_blocks = max((len(b) for b in block_tables), default=1) or 1
    bt = torch.zeros(len(block_tables), max_blocks, dtype=torch.int64)
    for i, b in enumerate(block_tables):
        if len(b) * block_size < seq_lens[i]:
            raise ValueError(f"sequence {i}: {len(b)} blocks cannot hold {seq_lens[i]} tokens")
        if b:
            bt[i, : len(b)] = torch.tensor(b, dtype=torch.int64)
    offs = torch.arange(block_size, dtype=torch.int64)
    all_slots = (bt[:, :, None] * block_size + offs[None, None, :]).reshape(len(block_tables), -1)
    slot_chunks = [all_slots[i, s - q: s] for i, (q, s) in enumerate(zip(query_lens, seq_lens))]
    slot_mapping = torch.cat(slot_chunks) if slot_chunks else torch.zeros(0, dtype=torch.int64)
    return qsl, bt, all_slots, slot_mapping
