"""``tinyvllm bench prefill`` (tinyvllm/benchmarks/prefill.py): its FLOP and byte counts, and one
run on a tiny random-weight model through the C++ backend."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.benchmarks.prefill import attention_flops, kv_bytes, run_prefill
from tinyvllm.entrypoints.cli import build_parser
from tinyvllm.kernels.cpu import cpu_kernels

from tiny_models import make_tiny_llama


def test_attention_flops_counts_every_causal_position():
    context, chunk, heads, d, layers, batch = 7, 5, 3, 16, 2, 4
    positions = sum(context + i + 1 for i in range(chunk))  # row i sees positions 0..context+i
    assert attention_flops(context, chunk, batch, heads, d, layers) == 2 * 2 * d * heads * positions * batch * layers
    assert attention_flops(100, 1, 16, heads, d, layers) == 4 * d * heads * 101 * 16 * layers  # decode
    assert kv_bytes(100, 1, 16, 2, d, layers) == 2 * 101 * 2 * d * 2 * 16 * layers


def test_bench_prefill_parser():
    args = build_parser(["bench", "prefill", "--context", "5000", "--chunk", "512"]).parse_args(
        ["bench", "prefill", "--context", "5000", "--chunk", "512"])
    assert args.bench_command == "prefill" and args.context == 5000 and args.chunk == 512 and args.batch == 1


@pytest.mark.skipif(cpu_kernels() is None, reason="C++ kernels could not be built")
def test_run_prefill_on_a_tiny_model(tmp_path):
    from tinyvllm.attention.selector import get_attn_backend
    from tinyvllm.model.weights import load_model

    path = make_tiny_llama(tmp_path / "m", hidden=128, num_heads=4, num_kv_heads=2)  # head_dim 32
    model = load_model(path, torch.bfloat16)
    backend = get_attn_backend("cpu", torch.bfloat16)
    model.bind_attn_backend(backend)
    inner = backend._rope_cache_attention
    res = run_prefill(model, backend, cpu_kernels(), context=100, chunk=20, batch=2, num_iters=2)
    assert backend._rope_cache_attention is inner  # the timer is removed
    cfg = model.config
    assert res["attention_flop"] == attention_flops(100, 20, 2, cfg.num_attention_heads, cfg.head_dim,
                                                    cfg.num_hidden_layers)
    assert 0 < res["attention_s"] < res["step_s"] * 1.01 and res["attention_gflops"] > 0
    assert (res["ceiling_gflops"] > 0) == cpu_kernels().has_tiled_attention()
    assert res["kernel"] == ("amx" if cpu_kernels().has_amx_attention() else
                             "avx512-bf16" if cpu_kernels().has_tiled_attention() else "row")
