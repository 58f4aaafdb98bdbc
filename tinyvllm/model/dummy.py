"""Model directories for ``--load-format dummy``: a ``config.json`` and a tokenizer, no weights.

Benchmarks of a model's *shape* (a GPU check at Llama-3.2-1B size, say) need no
download: :func:`write_dummy_model_dir` writes the config of a known shape and a
word-level tokenizer over its whole vocabulary (token ``i`` is the word ``w{i}``;
ids 0/1/2 are ``<unk>``/``<s>``/``</s>``), so every id the random model samples
detokenizes. The engine then fills the weights with seeded random values
(:func:`tinyvllm.model.weights.init_dummy_weights`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

# Llama-3.2-1B's config.json fields (published shape: 16 layers, hidden 2048, 32 query / 8 KV heads
# of 64, SwiGLU 8192, vocab 128256, tied embedding, llama3 RoPE scaling), max_position_embeddings
# lowered from 131072 to 8192 so the CUDA-graph block tables stay small.
LLAMA_3_2_1B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192},
    "tie_word_embeddings": True,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


# Qwen3-0.6B's published config.json (28 layers, hidden 1024, 16 query / 8 KV heads of 128, SwiGLU 3072,
# vocab 151936, tied embedding, rope theta 1e6), max_position_embeddings lowered from 40960 to 8192.
QWEN3_0_6B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
    "head_dim": 128, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
    "rope_scaling": None, "attention_bias": False, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
}

# Gemma-3-1B-it's published config.json (26 layers, hidden 1152, 4 query / 1 KV head of 256, GeGLU 6912,
# vocab 262144, sliding window 512 on 5 of every 6 layers, rope 1e6 global / 1e4 local).
GEMMA3_1B: dict[str, Any] = {
    "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "vocab_size": 262144, "hidden_size": 1152,
    "intermediate_size": 6912, "num_hidden_layers": 26, "num_attention_heads": 4, "num_key_value_heads": 1,
    "head_dim": 256, "query_pre_attn_scalar": 256, "sliding_window": 512, "sliding_window_pattern": 6,
    "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
    "rope_scaling": None, "hidden_activation": "gelu_pytorch_tanh", "final_logit_softcapping": None,
    "attn_logit_softcapping": None, "tie_word_embeddings": True, "bos_token_id": 2, "eos_token_id": 1,
}

# A small Qwen3-MoE (Qwen3-30B-A3B's layout shrunk: 12 layers, hidden 1024, 16 query / 4 KV heads of 128,
# 32 experts of width 512, top-8 renormalised; ~0.6 B parameters, ~0.2 B active per token).
QWEN3_MOE_SMALL: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 1024,
    "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 16, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 32, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "rope_scaling": None, "tie_word_embeddings": False,
    "bos_token_id": 1, "eos_token_id": 2,
}

SHAPES: dict[str, dict[str, Any]] = {
    "llama-3.2-1b": LLAMA_3_2_1B, "qwen3-0.6b": QWEN3_0_6B, "gemma-3-1b": GEMMA3_1B, "qwen3-moe-small": QWEN3_MOE_SMALL,
}
"""The shapes ``python -m tinyvllm.model.dummy --shape NAME`` writes."""


def save_word_level_tokenizer(path: str | Path, vocab_size: int) -> None:
    """Save a word-level tokenizer (``tokenizer.json`` + config) with ids ``0 .. vocab_size-1``:
    ``<unk>``, ``<s>``, ``</s>``, then ``w3 .. w{vocab_size-1}``, split on whitespace."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 4:
        raise ValueError(f"vocab_size must be >= 4, got {vocab_size}")
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                            unk_token="<unk>").save_pretrained(str(path))


def write_dummy_model_dir(path: str | Path, config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` (default :data:`LLAMA_3_2_1B`) and a word-level tokenizer of its
    vocabulary into ``path``; run it with ``load_format="dummy"``. Returns ``path``."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = dict(LLAMA_3_2_1B if config is None else config)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_word_level_tokenizer(path, int(config["vocab_size"]))
    return path


# ----------------------------------------------------------------------------- random GGUFs (issue 43)

_GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "smollm3": "smollm3", "gemma3_text": "gemma3",
              "qwen3_moe": "qwen3moe", "llama": "llama", "mistral": "llama"}
"""config.json ``model_type`` -> llama.cpp's GGUF ``general.architecture``."""


def _permute_qk(w: Any, n_head: int) -> Any:
    """llama.cpp's ``LlamaModel.permute`` (rotate-half rows -> interleaved pairs), for ``llama``/``smollm3``."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(cfg: dict[str, Any], tensors: Iterable[tuple[str, Any]], out: str | Path, *,
               linear_qtype: str = "F32", embedding_qtype: str = "F32") -> Path:
    """Write a GGUF under llama.cpp's tensor names and metadata for ``cfg``'s architecture (what
    ``convert_hf_to_gguf.py`` writes: q/k rows permuted for llama/smollm3, Gemma's norms stored as 1 + w,
    Qwen3-MoE experts stacked into ``ffn_*_exps``), with the embedded SmolLM2's gpt2-style BPE tokenizer
    (49,152 tokens); a larger ``cfg["vocab_size"]`` pads it with normal tokens ``[PAD<id>]`` (as
    ``convert_hf_to_gguf.py`` pads a vocabulary), so the embedding and LM head keep the real model's size.

    Args:
        cfg: an HF ``config.json`` dict (``model_type`` one of qwen2, qwen3, smollm3, gemma3_text, qwen3_moe,
            llama, mistral).
        tensors: ``(HF tensor name, numpy array [out, in] or [n])`` pairs, e.g. ``safetensors`` items; the
            per-expert ``mlp.experts.E.{gate,up,down}_proj.weight`` are stacked to ``[E, out, in]``.
        out: the file to write.
        linear_qtype: ``F32`` or a gguf quantization type (``Q8_0``, ``Q4_1``, ...; gguf's own numpy
            quantizer) for the 2D linear weights and an untied LM head.
        embedding_qtype: the same for ``token_embd`` (the LM head of a tied model; llama.cpp's converter
            quantizes it like the linears).

    Raises:
        ValueError: a tensor name with no GGUF name, or a vocabulary smaller than the tokenizer's.
    """
    import gguf
    import numpy as np

    from tinyvllm.model.loader import DEFAULT_MODEL_ALIAS, _find_alias_gguf, gguf_reader

    arch = _GGUF_ARCH[cfg["model_type"]]
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
            value = field.contents()
            if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
                if len(value) > cfg["vocab_size"]:
                    raise ValueError(f"write_gguf: vocab_size {cfg['vocab_size']} < the tokenizer's {len(value)}")
                pad = range(len(value), cfg["vocab_size"])
                value = list(value) + ([f"[PAD{i}]" for i in pad] if key.endswith("tokens")
                                       else [int(gguf.TokenType.NORMAL)] * len(pad))
            w.add_key_value(key, value, vt, field.types[1] if vt == gguf.GGUFValueType.ARRAY else None)

    def add(name: str, a: Any, qtype: str = "F32") -> None:
        a = np.ascontiguousarray(a.astype(np.float32))
        if qtype != "F32":
            qt = gguf.GGMLQuantizationType[qtype]
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
    n_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
    for name, a in tensors:
        if name.endswith("norm.weight") and arch == "gemma3":
            a = a + 1.0
        if name == "model.embed_tokens.weight":
            add("token_embd.weight", a, embedding_qtype)
        elif name == "model.norm.weight":
            add("output_norm.weight", a)
        elif name == "lm_head.weight":
            if not cfg.get("tie_word_embeddings"):
                add("output.weight", a, linear_qtype)
        else:
            _, _, i, rest = name.split(".", 3)
            if rest in linears:
                if permute and rest.startswith("self_attn.q_proj"):
                    a = _permute_qk(a, n_head)
                elif permute and rest.startswith("self_attn.k_proj"):
                    a = _permute_qk(a, n_kv)
                add(f"blk.{i}.{linears[rest]}", a, linear_qtype)
            elif rest in layer_names:
                add(f"blk.{i}.{layer_names[rest]}", a)
            elif rest.startswith("mlp.experts."):  # per expert: mlp.experts.E.{gate,up,down}_proj.weight
                _, _, e, kind, _ = rest.split(".")
                by_e = experts.setdefault((i, kind[: -len("_proj")]), {})
                by_e[int(e)] = a
                if len(by_e) == n_experts:  # llama.cpp's stacked [E, out, in] tensor, written once complete
                    add(f"blk.{i}.ffn_{kind[: -len('_proj')]}_exps.weight",
                        np.stack([by_e.pop(e) for e in sorted(by_e)]), linear_qtype)
            else:
                raise ValueError(f"write_gguf: no GGUF name for {name}")
    if any(experts.values()):
        raise ValueError(f"write_gguf: incomplete experts {sorted(k for k, v in experts.items() if v)}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(out)


def random_hf_tensors(cfg: dict[str, Any], *, seed: int = 0, std: float = 0.02) -> Iterator[tuple[str, Any]]:
    """Random float32 weights of ``cfg``'s shapes under HF's tensor names, one tensor at a time (numpy,
    ``N(0, std)`` for matrices, 1 for RMSNorm weights (0 for Gemma's ``1 + w`` norms), 0 for biases); for
    :func:`write_gguf` at a published model's size without its weights. Families: qwen2, qwen3, qwen3_moe,
    gemma3_text, llama, mistral."""
    import numpy as np

    rng = np.random.default_rng(seed)
    mt = cfg["model_type"]
    hidden, n_head, n_kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or hidden // n_head
    norm = 0.0 if mt == "gemma3_text" else 1.0

    def mat(rows: int, cols: int) -> Any:
        return rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(std)

    def ones(n: int) -> Any:
        return np.full(n, norm, np.float32)

    yield "model.embed_tokens.weight", mat(cfg["vocab_size"], hidden)
    for i in range(cfg["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        yield pre + "input_layernorm.weight", ones(hidden)
        yield pre + "post_attention_layernorm.weight", ones(hidden)
        if mt == "gemma3_text":
            yield pre + "pre_feedforward_layernorm.weight", ones(hidden)
            yield pre + "post_feedforward_layernorm.weight", ones(hidden)
        if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
            yield pre + "self_attn.q_norm.weight", ones(hd)
            yield pre + "self_attn.k_norm.weight", ones(hd)
        for p, rows in (("q", n_head * hd), ("k", n_kv * hd), ("v", n_kv * hd)):
            yield pre + f"self_attn.{p}_proj.weight", mat(rows, hidden)
            if mt == "qwen2":
                yield pre + f"self_attn.{p}_proj.bias", np.zeros(rows, np.float32)
        yield pre + "self_attn.o_proj.weight", mat(hidden, n_head * hd)
        if mt == "qwen3_moe":
            n_exp, inter = cfg["num_experts"], cfg["moe_intermediate_size"]
            yield pre + "mlp.gate.weight", mat(n_exp, hidden)
            for e in range(n_exp):
                yield pre + f"mlp.experts.{e}.gate_proj.weight", mat(inter, hidden)
                yield pre + f"mlp.experts.{e}.up_proj.weight", mat(inter, hidden)
                yield pre + f"mlp.experts.{e}.down_proj.weight", mat(hidden, inter)
        else:
            inter = cfg["intermediate_size"]
            yield pre + "mlp.gate_proj.weight", mat(inter, hidden)
            yield pre + "mlp.up_proj.weight", mat(inter, hidden)
            yield pre + "mlp.down_proj.weight", mat(hidden, inter)
    yield "model.norm.weight", ones(hidden)
    if not cfg.get("tie_word_embeddings"):
        yield "lm_head.weight", mat(cfg["vocab_size"], hidden)


def write_dummy_gguf(out: str | Path, config: dict[str, Any], *, qtype: str = "Q8_0", seed: int = 0) -> Path:
    """A random GGUF of ``config``'s shapes (:func:`random_hf_tensors` through :func:`write_gguf`), every
    linear, the embedding and the LM head in ``qtype``: one file that tinyvllm (``--quantization gguf``) and
    llama.cpp both run, for speed comparisons at a published model's shape (benchmarks/dummy_vs_llamacpp.sh)."""
    return write_gguf(config, random_hf_tensors(config, seed=seed), out, linear_qtype=qtype, embedding_qtype=qtype)


def main(argv: list[str] | None = None) -> int:
    """``python -m tinyvllm.model.dummy DIR [--shape NAME] [KEY=VALUE ...]``: write a dummy model directory
    (Llama-3.2-1B's shape, or ``--shape`` qwen3-0.6b / gemma-3-1b / qwen3-moe-small, with config fields
    overridden by ``KEY=VALUE``, values parsed as JSON)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tinyvllm.model.dummy", description=main.__doc__)
    p.add_argument("dir", help="directory to write config.json and the tokenizer into")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES),
                   help="the published model whose config.json shapes to write (default llama-3.2-1b)")
    p.add_argument("--gguf", metavar="QTYPE", default=None,
                   help="write DIR as one random-weight GGUF file instead (llama.cpp's names and metadata, "
                        "linears/embedding in QTYPE, e.g. Q8_0 or Q4_1; SmolLM2's tokenizer padded to the vocab)")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                   help="config.json fields to change, e.g. num_hidden_layers=2 vocab_size=1000")
    args = p.parse_intermixed_args(argv)
    config = dict(SHAPES[args.shape])
    for item in args.overrides:
        key, sep, value = item.partition("=")
        if not sep or key not in config:
            p.error(f"{item!r}: expected KEY=VALUE with KEY one of {', '.join(config)}")
        try:
            config[key] = json.loads(value)
        except json.JSONDecodeError:
            p.error(f"{item!r}: the value must be JSON (a number, true/false, a quoted string, an object)")
    if args.gguf:
        path = write_dummy_gguf(args.dir, config, qtype=args.gguf)
        print(f"wrote {path} ({args.shape} shapes, random {args.gguf} weights, vocab {config['vocab_size']}); "
              f"run it with --model {path} --quantization gguf")
        return 0
    path = write_dummy_model_dir(args.dir, config)
    print(f"wrote {path}/config.json and a {config['vocab_size']}-word tokenizer; "
          f"run it with --model {path} --load-format dummy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
