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


def _permute_qk(w: Any, n_head: int) -> Any:
    """llama.cpp's ``LlamaModel.permute`` (rotate-half rows -> interleaved pairs), for ``llama``/``smollm3``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_family_gguf(hf_dir: Path, out: Path, *, linear_qtype: str = "F32") -> Path:
    """Write the HF checkpoint ``hf_dir`` (from :func:`make_tiny_family`) as a GGUF under llama.cpp's
    tensor names and metadata for its architecture (what ``convert_hf_to_gguf.py`` writes: q/k rows
    permuted for llama/smollm3, Gemma's norms stored as 1 + w, Qwen3-MoE experts stacked into
    ``ffn_*_exps``), with the embedded SmolLM2's tokenizer. ``linear_qtype``: ``F32`` or ``Q8_0``
    (quantized with gguf's own quantizer) for the 2D linear weights."""
    import json

    import gguf
    import numpy as np
    from safetensors.numpy import load_file

    from tinyvllm.model.loader import DEFAULT_MODEL_ALIAS, _find_alias_gguf, gguf_reader

    cfg = json.loads((hf_dir / "config.json").read_text())
    mt = cfg["model_type"]
    arch = {"qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3", "gemma3_text": "gemma3",
            "qwen3_moe": "qwen3moe", "llama": "llama", "mistral": "llama"}[mt]
    t = load_file(str(hf_dir / "model.safetensors"))
    n_head, n_kv, hidden = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // n_head
    src = gguf_reader(_find_alias_gguf(DEFAULT_MODEL_ALIAS))
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(head_dim)
    rp = cfg.get("rope_parameters") or {}
    rp = rp.get("full_attention", rp)
    w.add_rope_freq_base(float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    if arch == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
    if arch == "qwen3moe":
        w.add_expert_count(cfg.get("num_experts", cfg.get("num_local_experts")))
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    for key, field in src.fields.items():
        if key.startswith("tokenizer."):
            vt = field.types[0]
            w.add_key_value(key, field.contents(), vt, field.types[1] if vt == gguf.GGUFValueType.ARRAY else None)

    def add(name: str, a: Any, linear: bool = False) -> None:
        a = np.ascontiguousarray(a.astype(np.float32))
        if linear and linear_qtype != "F32":
            qt = gguf.GGMLQuantizationType[linear_qtype]
            w.add_tensor(name, gguf.quants.quantize(a, qt), raw_dtype=qt)
        else:
            w.add_tensor(name, a)

    layer_names = {
        "input_layernorm.weight": "attn_norm.weight",
        "post_attention_layernorm.weight": "post_attention_norm.weight" if arch == "gemma3" else "ffn_norm.weight",
        "pre_feedforward_layernorm.weight": "ffn_norm.weight",
        "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
        "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
        "mlp.gate.weight": "ffn_gate_inp.weight",
    }
    for p in ("q", "k", "v"):
        layer_names[f"self_attn.{p}_proj.bias"] = f"attn_{p}.bias"
    linears = {"self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
               "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
               "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
               "mlp.down_proj.weight": "ffn_down.weight"}
    permute = arch in ("llama", "smollm3")
    experts: dict[tuple[str, str], dict[int, Any]] = {}  # (layer, gate|up|down) -> expert -> [out, in]
    for name, tensor in t.items():
        a = tensor
        if name.endswith("norm.weight") and arch == "gemma3":
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                add("output.weight", a, linear=True)
        else:
            _, _, i, rest = name.split(".", 3)
            if rest in linears:
                if permute and rest.startswith("self_attn.q_proj"):
                    a = _permute_qk(a, n_head)
                elif permute and rest.startswith("self_attn.k_proj"):
                    a = _permute_qk(a, n_kv)
                add(f"blk.{i}.{linears[rest]}", a, linear=True)
            elif rest in layer_names:
                add(f"blk.{i}.{layer_names[rest]}", a)
            elif rest.startswith("mlp.experts."):  # per expert: mlp.experts.E.{gate,up,down}_proj.weight
                _, _, e, kind, _ = rest.split(".")
                experts.setdefault((i, kind[: -len("_proj")]), {})[int(e)] = a
            else:
                raise ValueError(f"write_family_gguf: no GGUF name for {name}")
    for (i, kind), by_e in sorted(experts.items()):  # llama.cpp's stacked [E, out, in] expert tensors
        add(f"blk.{i}.ffn_{kind}_exps.weight", np.stack([by_e[e] for e in sorted(by_e)]), linear=True)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
