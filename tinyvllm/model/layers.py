"""Llama building blocks: RMSNorm and rotary position embeddings (default and llama3 scaling).

No backend dispatch here: the per-layer ops are the attention backend's (:mod:`tinyvllm.attention`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tinyvllm.attention import torch_ref


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32.

    ``y = x / sqrt(mean(x^2) + eps) * weight``, with the same dtype handling as
    Hugging Face's ``LlamaRMSNorm`` (normalise in float32, cast back, then scale).
    Input/output: [..., hidden] in the model dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` [T, H] (the PyTorch reference, :func:`tinyvllm.attention.torch_ref.rms_norm`);
        with ``residual`` [T, H], first ``x = x + residual`` (in the model dtype) and return
        ``(normed, x)`` — the fused residual add of a pre-norm transformer. (The model's forward calls
        its attention backend's ``rms_norm`` with this module's weight and eps instead.)"""
        out, x = torch_ref.rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, x)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d)`` of RoPE (Su et al. 2021, RoFormer, eq. 15).

    With ``rope_type == "llama3"`` applies Llama 3.1's frequency-dependent scaling
    (Meta's Llama 3.1 reference implementation ``apply_scaling``): wavelengths longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``.../high_freq_factor`` are kept, and the band between
    is interpolated smoothly. ``linear`` scaling divides all frequencies by ``factor``.

    Returns:
        [head_dim // 2] float32.

    Raises:
        ValueError: an unsupported rope type.
    """
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX / HF Llama) rotary embedding applied per token by position.

    Holds a cos/sin table [max_positions, head_dim // 2] (float32) built lazily.
    """

    def __init__(self, head_dim: int, max_position: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        # On the CPU even when the model is built on ``meta``: arithmetic on meta tensors runs Python
        # reference implementations that import torch._dynamo (1.5 s). load_model recomputes it anyway.
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(head_dim, rope_theta, rope_scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._cos_sin: torch.Tensor | None = None
        self.max_position = max_position

    def tables(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full cos and sin tables, each [>= needed, D/2] float32 (built once, grown if needed)."""
        if self._cos is None or self._cos.shape[0] < needed:
            n = max(needed, self.max_position)
            pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
            freqs = pos[:, None] * self.inv_freq[None, :].float()
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin

    def cos_sin_cache(self, needed: int) -> torch.Tensor:
        """cos and sin side by side, [>= needed, D] float32 (the Triton rotary kernel's table)."""
        cos, sin = self.tables(needed)
        if self._cos_sin is None or self._cos_sin.shape[0] != cos.shape[0]:
            self._cos_sin = torch.cat([cos, sin], dim=-1).contiguous()
        return self._cos_sin
