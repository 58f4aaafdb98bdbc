"""Our Llama forward pass (packed batch, paged KV) against transformers' LlamaForCausalLM, float32."""

from __future__ import annotations

import random

import pytest
import torch

from tinyvllm.attention.selector import get_attn_backend
from tinyvllm.model.weights import load_model

from tiny_models import make_tiny_llama

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(tie=False, num_heads=4, num_kv_heads=2),           # GQA, untied head
        dict(tie=True, num_heads=4, num_kv_heads=4),            # MHA, tied head
        dict(tie=False, num_heads=6, num_kv_heads=2, hidden=96, rope_scaling=LLAMA3),  # GQA 3:1 + llama3 RoPE
    ],
    ids=["gqa-untied", "mha-tied", "gqa-llama3"],
)
def test_prefill_and_decode_logits_match_transformers(tmp_path, kwargs):
    from transformers import LlamaForCausalLM as HFLlama

    path = make_tiny_llama(tmp_path / "m", **kwargs)
    hf = HFLlama.from_pretrained(str(path), torch_dtype=torch.float32).eval()
    ours = load_model(path, torch.float32)
    backend = get_attn_backend("cpu", torch.float32)
    ours.bind_attn_backend(backend)
    cfg = ours.config

    block_size, num_blocks = 4, 32
    kv = [torch.full((2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim), float("nan"))
          for _ in range(cfg.num_hidden_layers)]
    # Non-contiguous, shuffled physical blocks.
    blocks = list(range(num_blocks))
    random.Random(0).shuffle(blocks)

    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, cfg.vocab_size, (45,), generator=g).tolist()  # long enough for llama3 scaling
    tokens = list(prompt)
    with torch.no_grad():
        # Prefill in two chunks (cached-prefix path), then decode steps.
        steps = [(0, 20), (20, 45)] + [(45 + i, 46 + i) for i in range(6)]
        for start, end in steps:
            new = tokens[start:end]
            nblk = (end + block_size - 1) // block_size
            md = backend.build_metadata([end - start], [end], [blocks[:nblk]], block_size)
            hidden = ours(torch.tensor(new), torch.arange(start, end), kv, md)
            logits = ours.compute_logits(hidden)
            ref = hf(torch.tensor([tokens[:end]])).logits[0, start:end].float()
            assert _rel_err(logits, ref) < 1e-4, (start, end, _rel_err(logits, ref))
            if end >= len(prompt):
                tokens.append(int(ref[-1].argmax()))


def test_llama3_rope_scaling_changes_frequencies():
    from tinyvllm.model.layers import rope_inv_freq

    plain = rope_inv_freq(64, 500000.0, None)
    scaled = rope_inv_freq(64, 500000.0, {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    assert torch.equal(scaled[:4], plain[:4])           # high frequencies kept
    assert torch.allclose(scaled[-1], plain[-1] / 32)   # low frequencies divided by factor


def test_bad_weights_raise(tmp_path):
    from safetensors.torch import load_file, save_file

    path = make_tiny_llama(tmp_path / "m")
    tensors = load_file(str(path / "model.safetensors"))
    tensors.pop("model.layers.0.mlp.up_proj.weight")
    save_file(tensors, str(path / "model.safetensors"))
    with pytest.raises(ValueError, match="incomplete"):
        load_model(path, torch.float32)
