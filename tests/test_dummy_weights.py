"""``--load-format dummy``: random weights of a config's shapes, no weight files (for shape benchmarks)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from tinyvllm import LLM, SamplingParams
from tinyvllm.model.dummy import LLAMA_3_2_1B, write_dummy_model_dir
from tinyvllm.model.llama import LlamaConfig
from tinyvllm.model.weights import load_model
from tinyvllm.model.loader import ModelNotFoundError

TINY = dict(LLAMA_3_2_1B, vocab_size=300, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
            rope_scaling={**LLAMA_3_2_1B["rope_scaling"], "original_max_position_embeddings": 64})
ENGINE = dict(dtype="float32", device="cpu", block_size=4, num_kv_blocks=64, max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    return write_dummy_model_dir(tmp_path_factory.mktemp("dummy"), TINY)


def test_dummy_dir_has_no_weights_and_auto_refuses_it(dummy_dir):
    assert not list(dummy_dir.glob("*.safetensors"))
    assert json.loads((dummy_dir / "config.json").read_text())["vocab_size"] == 300
    with pytest.raises(ModelNotFoundError, match="load-format dummy"):
        LLM(str(dummy_dir), **ENGINE)


def test_dummy_weights_are_seeded_and_shaped(dummy_dir):
    a = load_model(dummy_dir, torch.float32, load_format="dummy", seed=3)
    b = load_model(dummy_dir, torch.float32, load_format="dummy", seed=3)
    c = load_model(dummy_dir, torch.float32, load_format="dummy", seed=4)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    w = "layers.0.mlp.down_proj.weight"
    assert not torch.equal(sa[w], sc[w])
    assert sa[w].shape == (64, 160)
    assert abs(float(sa[w].std()) - 160 ** -0.5) < 0.01  # N(0, 1/in_features)
    assert torch.equal(sa["norm.weight"], torch.ones(64))
    assert a.config == LlamaConfig.from_dir(dummy_dir)
    with pytest.raises(ValueError, match="load_format"):
        load_model(dummy_dir, torch.float32, load_format="pt")


def test_engine_runs_dummy_model_with_every_token_detokenizable(dummy_dir):
    llm = LLM(str(dummy_dir), load_format="dummy", **ENGINE)
    sp = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True, seed=7)
    outs = llm.generate([{"prompt_token_ids": list(range(3, 30))}, "w5 w6 w7"], sp)
    for o in outs:
        ids = o.outputs[0].token_ids
        assert len(ids) == 12 and all(0 <= t < 300 for t in ids)
        # Word-level tokenizer over the whole vocabulary: the text is the sampled ids' words.
        assert o.outputs[0].text.split() == [f"w{t}" for t in ids if t >= 3]
    assert outs[1].prompt_token_ids == [5, 6, 7]


def test_cli_flag_and_config_validation():
    from tinyvllm.config import EngineArgs, ModelConfig

    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    assert EngineArgs.from_cli_args(p.parse_args([])).load_format == "auto"
    assert EngineArgs.from_cli_args(p.parse_args(["--load-format", "dummy"])).load_format == "dummy"
    with pytest.raises(ValueError, match="load_format"):
        ModelConfig(load_format="pt")


def test_module_command_writes_a_dir_with_overrides(tmp_path, capsys):
    from tinyvllm.model.dummy import main

    assert main([str(tmp_path / "m"), "num_hidden_layers=2", "vocab_size=40", "tie_word_embeddings=false"]) == 0
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and cfg["vocab_size"] == 40 and cfg["tie_word_embeddings"] is False
    assert cfg["hidden_size"] == LLAMA_3_2_1B["hidden_size"]
    assert "--load-format dummy" in capsys.readouterr().out
    for bad in (["no_such_field=1"], ["vocab_size=abc"], ["vocab_size"]):
        with pytest.raises(SystemExit) as e:
            main([str(tmp_path / "n"), *bad])
        assert e.value.code == 2


def test_run_latency_times_full_batch_decode_steps(dummy_dir):
    """``bench latency``'s decode figure: steps where the whole batch decodes; with a chunked prefill
    the first sequences start decoding (and finish) before the last ones, and those steps are left out."""
    from tinyvllm.benchmarks.throughput import run_latency

    llm = LLM(str(dummy_dir), load_format="dummy", **ENGINE)  # 16-token budget: 4 x 24 prompt tokens take 6 steps
    r = run_latency(llm, input_len=24, output_len=12, batch_size=4, num_iters=1)
    assert r["decode_batch"] == 4 and r["num_decode_steps"] >= 1
    assert r["decode_tokens_per_s"] == pytest.approx(4 / r["decode_step_s"])
    assert r["prefill_tokens_per_s"] == pytest.approx(4 * 24 / r["prefill_s"])
    # Two new tokens each: the batch never decodes all together, so the mean batch of the decode steps is given.
    r = run_latency(llm, input_len=24, output_len=2, batch_size=4, num_iters=1, seed=5)  # new prompts: no cache hit
    assert 1 <= r["decode_batch"] < 4 and r["num_decode_steps"] >= 1
    assert r["decode_tokens_per_s"] == pytest.approx(r["decode_batch"] / r["decode_step_s"])


@pytest.mark.parametrize("tie", [True, False])
def test_roofline_model_costs_match_the_model_built_from_the_config(tie):
    """gpu_bench.py's rooflines rest on ``model_costs``: its parameter count must be the module's own."""
    from tinyvllm.benchmarks.roofline import model_costs
    from tinyvllm.model.llama import LlamaForCausalLM

    cfg = dict(LLAMA_3_2_1B, tie_word_embeddings=tie)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig.from_dict(cfg))
    n = sum(p.numel() for p in model.parameters())
    c = model_costs(cfg, 2)
    assert c["params"] == n
    head = cfg["vocab_size"] * cfg["hidden_size"]
    layer_linear = sum(p.numel() for name, p in model.layers.named_parameters() if p.dim() == 2)
    assert c["linear_flops_per_token"] == 2 * layer_linear
    assert c["head_flops_per_row"] == 2 * head
    # A decode step reads every weight once; a tied table is both the embedding and the head.
    assert c["weight_bytes"] == 2 * (n if tie else n - head)
    assert c["kv_bytes_per_token"] == LlamaConfig.from_dict(cfg).kv_bytes_per_token(torch.bfloat16)
    if tie:
        assert n == 1_235_814_400  # Llama-3.2-1B's published parameter count (its "1.24B")


@pytest.mark.slow  # 24 s at load 15 (the 49K-token tokenizer's padding and Q8_0 embedding)
def test_dummy_gguf_has_llamacpp_names_shapes_and_padded_vocab(tmp_path):
    """``write_dummy_gguf`` (issue 43's llama.cpp comparisons): the shapes of the config under llama.cpp's
    tensor names, Q8_0 linears/embedding, experts stacked [E, out, in], the tokenizer padded to vocab_size."""
    import gguf

    from tinyvllm.model.dummy import QWEN3_MOE_SMALL, write_dummy_gguf

    cfg = dict(QWEN3_MOE_SMALL, num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, vocab_size=49152 + 100)
    r = gguf.GGUFReader(str(write_dummy_gguf(tmp_path / "m.gguf", cfg, qtype="Q8_0")))
    t = {x.name: x for x in r.tensors}
    assert r.fields["general.architecture"].contents() == "qwen3moe"
    assert r.fields["qwen3moe.expert_count"].contents() == 4
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == cfg["vocab_size"] and tokens[-1] == f"[PAD{cfg['vocab_size'] - 1}]"
    assert len(r.fields["tokenizer.ggml.token_type"].contents()) == cfg["vocab_size"]
    assert t["token_embd.weight"].tensor_type == gguf.GGMLQuantizationType.Q8_0
    assert list(t["blk.0.ffn_gate_exps.weight"].shape) == [64, 32, 4]  # gguf lists dims innermost first
    assert list(t["blk.0.ffn_down_exps.weight"].shape) == [32, 64, 4]
    assert list(t["blk.0.attn_k.weight"].shape) == [64, 64]
    assert "output.weight" in t and "blk.0.attn_q_norm.weight" in t
