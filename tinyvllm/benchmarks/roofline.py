"""Roofline arithmetic for a Llama-architecture model: bytes and FLOPs of a prefill or a decode step.

A step's time is bounded below by ``max(bytes moved / memory bandwidth, FLOPs / matmul rate)``
(Williams, Waterman & Patterson 2009, "Roofline: an insightful visual performance model for
multicore architectures"). ``scripts/gpu_bench.py`` divides these bounds by its measured times.
"""

from __future__ import annotations

from typing import Any


def model_costs(config: dict[str, Any], elem_bytes: int) -> dict[str, int]:
    """Weights and per-token work of a Llama model, from its Hugging Face ``config.json`` fields.

    Args:
        config: ``vocab_size``, ``hidden_size``, ``intermediate_size``, ``num_hidden_layers``,
            ``num_attention_heads``, ``num_key_value_heads``, optional ``head_dim`` and
            ``tie_word_embeddings``.
        elem_bytes: bytes per weight and KV element (2 for bf16).
    Returns:
        ``weight_bytes``: bytes a decode step reads once (every layer, the norms, the LM head; the
        embedding lookup reads only the batch's rows, so a tied table counts once);
        ``linear_flops_per_token``: FLOPs of the layers' matmuls per token (2 per multiply-add);
        ``head_flops_per_row``: FLOPs of the LM head per sampled row;
        ``attn_flops_per_pair``: FLOPs of QK^T and PV per (query token, context token) pair, all layers;
        ``kv_bytes_per_token``: K and V bytes of one context token, all layers;
        ``params``: parameter count (untied heads counted twice).
    """
    H, inter, V = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    layers, hq, hk = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    d = config.get("head_dim") or H // hq
    per_layer = H * (hq + 2 * hk) * d + hq * d * H + 3 * H * inter  # qkv, o, gate+up, down
    norms = layers * 2 * H + H
    return {
        "weight_bytes": (layers * per_layer + norms + V * H) * elem_bytes,
        "linear_flops_per_token": 2 * layers * per_layer,
        "head_flops_per_row": 2 * V * H,
        "attn_flops_per_pair": 4 * layers * hq * d,
        "kv_bytes_per_token": 2 * layers * hk * d * elem_bytes,
        "params": layers * per_layer + norms + V * H * (1 if config.get("tie_word_embeddings") else 2),
    }
