"""Qwen3 (Qwen team 2025; 0.6B-32B dense): Llama's layers plus per-head q/k RMSNorm, no QKV bias.

What differs from Llama: after the q and k projections each head's D features go through an RMSNorm
(``q_norm`` / ``k_norm``, weights of size head_dim) before RoPE (HF ``Qwen3Attention``; vLLM
``qwen3.py``); ``head_dim`` is its own config field (128 in every size, not hidden / heads). The
norm runs as the attention backend's ``rms_norm`` over [tokens * heads, head_dim] rows
(:meth:`tinyvllm.model.layers.Attention._qk_norm`); no kernel fuses it with the projection.
``use_sliding_window`` (off in the released models) caps the context at the window. GGUF: llama.cpp's
``qwen3`` (``attn_q_norm`` / ``attn_k_norm``; q/k rows not permuted).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tinyvllm.model.llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Config(LlamaConfig):
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3Config":
        cfg = super().from_dict(d)
        if d.get("use_sliding_window"):
            cfg.cap_to_sliding_window(d.get("sliding_window"), "Qwen3")
        return cfg


class Qwen3ForCausalLM(LlamaForCausalLM):
    config_class = Qwen3Config

    def make_layer(self, cfg: LlamaConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, attn=LlamaAttention(cfg, qk_norm_eps=cfg.rms_norm_eps))
