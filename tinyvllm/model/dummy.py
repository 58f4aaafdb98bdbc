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


def main(argv: list[str] | None = None) -> int:
    """``python -m tinyvllm.model.dummy DIR [--shape NAME] [KEY=VALUE ...]``: write a dummy model directory
    (Llama-3.2-1B's shape, or ``--shape`` qwen3-0.6b / gemma-3-1b / qwen3-moe-small, with config fields
    overridden by ``KEY=VALUE``, values parsed as JSON)."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tinyvllm.model.dummy", description=main.__doc__)
    p.add_argument("dir", help="directory to write config.json and the tokenizer into")
    p.add_argument("--shape", default="llama-3.2-1b", choices=sorted(SHAPES),
                   help="the published model whose config.json shapes to write (default llama-3.2-1b)")
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
    path = write_dummy_model_dir(args.dir, config)
    print(f"wrote {path}/config.json and a {config['vocab_size']}-word tokenizer; "
          f"run it with --model {path} --load-format dummy")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
