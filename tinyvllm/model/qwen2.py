"""Qwen2 / Qwen2.5 (Qwen team 2024): Llama's layers plus a bias on the q, k and v projections (not on o).

What differs from Llama: ``qkv_proj`` has a bias, ``o_proj`` none (HF ``Qwen2Attention``; vLLM
``qwen2.py``). ``use_sliding_window`` (off in every released Qwen2.5) caps the context at
``sliding_window`` (:meth:`~tinyvllm.model.llama.LlamaConfig.cap_to_sliding_window`). GGUF:
llama.cpp's ``qwen2`` (``attn_q.bias`` ...; q/k rows not permuted).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from tinyvllm.model.llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


class Qwen2Config(LlamaConfig):
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen2Config":
        cfg = super().from_dict(d)
        if d.get("use_sliding_window"):
            cfg.cap_to_sliding_window(d.get("sliding_window"), "Qwen2")
        return cfg


class Qwen2ForCausalLM(LlamaForCausalLM):
    config_class = Qwen2Config

    def make_layer(self, cfg: LlamaConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, attn=LlamaAttention(cfg, qkv_bias=True, o_bias=False))
