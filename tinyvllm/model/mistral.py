"""Mistral / Ministral (Jiang et al. 2023): Llama's layers; what differs is the sliding window.

``config.sliding_window`` (4096 in Mistral-7B-v0.1; null in v0.2+) limits each query at position ``p``
to the keys at ``p - sliding_window + 1 .. p`` in every layer (transformers' convention; Jiang et al.
2023, section 2), on every attention backend (:class:`~tinyvllm.model.layers.Attention` ``window``).
The blocks before the window are skipped by the kernels, not freed (see docs/models.md). Weight names,
GGUF (llama.cpp writes Mistral as ``llama``, with no window key: such a file loads without a window)
and everything else are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from tinyvllm.model.llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


@dataclass
class MistralConfig(LlamaConfig):
    sliding_window: int | None = None

    @classmethod
    def extra_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        return {"sliding_window": d.get("sliding_window")}


class MistralForCausalLM(LlamaForCausalLM):
    config_class = MistralConfig

    def make_layer(self, cfg: MistralConfig, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, attn=LlamaAttention(cfg, window=int(cfg.sliding_window or 0)))
