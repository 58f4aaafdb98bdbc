"""Mistral / Ministral (Jiang et al. 2023): Llama's layers; what differs is the sliding window.

``config.sliding_window`` (4096 in Mistral-7B-v0.1; null in v0.2+) limits each query to the last
``sliding_window`` keys. The attention kernels attend over the whole context and have no window, so a
window shorter than ``max_position_embeddings`` caps the context at the window (with a warning;
:meth:`~tinyvllm.model.llama.LlamaConfig.cap_to_sliding_window`), where full and windowed attention
are the same: never a silently wrong model. Weight names, GGUF (llama.cpp writes Mistral as ``llama``)
and everything else are Llama's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tinyvllm.model.llama import LlamaConfig, LlamaForCausalLM


@dataclass
class MistralConfig(LlamaConfig):
    sliding_window: int | None = None

    @classmethod
    def extra_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        return {"sliding_window": d.get("sliding_window")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "MistralConfig":
        cfg = super().from_dict(d)
        cfg.cap_to_sliding_window(cfg.sliding_window, "Mistral")
        return cfg


class MistralForCausalLM(LlamaForCausalLM):
    config_class = MistralConfig
