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


# ----------------------------------------------------------------------------- model families (issue 43)

GGUF_VOCAB = 49152  # the embedded SmolLM2's tokenizer, copied into the family GGUFs

# Per family: transformers' config class, its tiny config (the family's head layout: GQA ratio,
# head_dim != hidden / heads where the family has it, tied embeddings, window, MoE top-k), and the
# llama.cpp GGUF architecture.
FAMILIES: dict[str, dict[str, Any]] = {
    "qwen2": dict(cls="Qwen2", gguf_arch="qwen2", cfg=dict(
        hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        tie_word_embeddings=True, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})),
    "qwen3": dict(cls="Qwen3", gguf_arch="qwen3", cfg=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, tie_word_embeddings=True, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})),
    "smollm3": dict(cls="SmolLM3", gguf_arch="smollm3", cfg=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1,
        tie_word_embeddings=True, no_rope_layers=[1, 1, 1, 0], no_rope_layer_interval=4,
        rope_parameters={"rope_theta": 2000000.0, "rope_type": "default"})),
    "mistral": dict(cls="Mistral", gguf_arch=None, cfg=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, tie_word_embeddings=False, sliding_window=8,
        rope_parameters={"rope_theta": 10000.0, "rope_type": "default"})),
    "gemma3": dict(cls="Gemma3Text", model="Gemma3", gguf_arch="gemma3", cfg=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=1,
        head_dim=32, query_pre_attn_scalar=32, sliding_window=8, tie_word_embeddings=True,
        layer_types=["sliding_attention"] * 5 + ["full_attention"],  # llama.cpp's fixed pattern of 6
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 1000000.0}})),
    "qwen3moe": dict(cls="Qwen3Moe", gguf_arch="qwen3moe", cfg=dict(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
        tie_word_embeddings=False, rope_parameters={"rope_theta": 1000000.0, "rope_type": "default"})),
}


def make_tiny_family(path: Path, family: str, *, vocab: int = GGUF_VOCAB, seed: int = 0,
                     **overrides: Any) -> Path:
    """Save transformers' own ``<Family>ForCausalLM`` with random float32 weights (larger than the default
    init so differences show; norm weights and biases random too) and a word-level tokenizer of its
    vocabulary to ``path``; return ``path``."""
    import transformers

    from tinyvllm.model.dummy import save_word_level_tokenizer

    spec = FAMILIES[family]
    cfg_cls = getattr(transformers, spec["cls"] + "Config")
    model_cls = getattr(transformers, spec.get("model", spec["cls"]) + "ForCausalLM")
    kw = dict(vocab_size=vocab, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)
    kw.update(spec["cfg"])
    kw.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kw)).to(torch.float32)
    gemma = family == "gemma3"
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.08)
            elif name.endswith("norm.weight"):
                p.normal_(0.0 if gemma else 1.0, 0.1)  # Gemma's norms scale by (1 + w)
            else:
                p.normal_(0, 0.1)  # biases
    model.save_pretrained(str(path), safe_serialization=True)
    save_word_level_tokenizer(path, vocab)
    return path


def write_family_gguf(hf_dir: Path, out: Path, *, linear_qtype: str = "F32") -> Path:
    """Write the HF checkpoint ``hf_dir`` (from :func:`make_tiny_family`) as a GGUF under llama.cpp's
    tensor names and metadata for its architecture (:func:`tinyvllm.model.dummy.write_gguf`: q/k rows
    permuted for llama/smollm3, Gemma's norms stored as 1 + w, Qwen3-MoE experts stacked into
    ``ffn_*_exps``), with the embedded SmolLM2's tokenizer. ``linear_qtype``: ``F32`` or ``Q8_0``
    (quantized with gguf's own quantizer) for the 2D linear weights."""
    import json

    from safetensors.numpy import load_file

    from tinyvllm.model.dummy import write_gguf

    cfg = json.loads((hf_dir / "config.json").read_text())
    return write_gguf(cfg, load_file(str(hf_dir / "model.safetensors")).items(), out, linear_qtype=linear_qtype)
