"""SmolLM3 (Hugging Face 2025, 3B): Llama's layers with NoPE on every 4th layer, tied embeddings.

What differs from Llama: layer ``i`` applies no rotary embedding where ``config.no_rope_layers[i]`` is
0 (HF ``SmolLM3Attention.use_rope``; by default every ``no_rope_layer_interval`` = 4th layer: 3, 7,
11, ...). Those layers get the identity rotary (cos = 1, sin = 0: the backends' RoPE then leaves q and
k bit for bit unchanged; :class:`~tinyvllm.model.layers.RotaryEmbedding` ``identity=True``), so the
attention kernels need no NoPE switch. The embedding is tied to the LM head in the released model
(``tie_word_embeddings``, as Llama handles it). GGUF: llama.cpp's ``smollm3`` (Llama's tensor names
and q/k row permutation; llama.cpp fixes the NoPE interval at 4, so the converter does too).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from tinyvllm.model.layers import RotaryEmbedding
from tinyvllm.model.llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


@dataclass
class SmolLM3Config(LlamaConfig):
    no_rope_layers: list[int] = field(default_factory=list)  # per layer: 1 = RoPE, 0 = NoPE

    @classmethod
    def extra_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        n = int(d["num_hidden_layers"])
        layers = d.get("no_rope_layers")
        if not layers:
            interval = int(d.get("no_rope_layer_interval", 4))
            layers = [int((i + 1) % interval != 0) for i in range(n)]
        if len(layers) != n:
            raise ValueError(f"SmolLM3 config: no_rope_layers has {len(layers)} entries for {n} layers")
        return {"no_rope_layers": [int(x) for x in layers]}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "SmolLM3Config":
        cfg = super().from_dict(d)
        if d.get("use_sliding_window"):
            cfg.cap_to_sliding_window(d.get("sliding_window"), "SmolLM3")
        return cfg


class SmolLM3ForCausalLM(LlamaForCausalLM):
    config_class = SmolLM3Config

    def make_rotaries(self, cfg: LlamaConfig) -> list[RotaryEmbedding]:
        rope = super().make_rotaries(cfg)[0]
        return [rope, RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, identity=True)]

    def make_layer(self, cfg: SmolLM3Config, index: int) -> nn.Module:
        return LlamaDecoderLayer(cfg, attn=LlamaAttention(cfg, rope_index=0 if cfg.no_rope_layers[index] else 1))
