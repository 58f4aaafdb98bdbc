"""Tiny random-weight Llama models written to a temp dir (safetensors + config.json), for fast unit tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch


def make_tiny_llama(path: Path, *, tie: bool = False, rope_scaling: dict[str, Any] | None = None,
                    num_heads: int = 4, num_kv_heads: int = 2, hidden: int = 64, layers: int = 2,
                    vocab: int = 128, seed: int = 0) -> Path:
    """Save a random ``transformers.LlamaForCausalLM`` (float32) to ``path``; return ``path``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    kwargs: dict[str, Any] = dict(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden + 32,
        num_hidden_layers=layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=tie,
        bos_token_id=1, eos_token_id=2,
    )
    if rope_scaling is not None:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    else:
        kwargs["rope_parameters"] = {"rope_theta": 10000.0, "rope_type": "default"}
    cfg = LlamaConfig(**kwargs)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():  # make weights larger than the default init so differences show
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
    model.save_pretrained(str(path), safe_serialization=True)
    return path
