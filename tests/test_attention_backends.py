"""The attention backend is chosen once per engine (``attention/selector.py``) and bound to the model.

* the selection rules (``TINYVLLM_ATTENTION``, dtype), and which backend packs the weights;
* engine-level greedy exactness of the C++ (``cpu``) and PyTorch reference (``torch``) backends on a
  tiny random model: each is batch invariant on its own (batched == one at a time, chunked prefill,
  prefix-cache hits) and both give the same tokens;
* once the engine is built, no step selects a backend or loads the kernels again.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_llama

from tinyvllm import LLM, SamplingParams
from tinyvllm.attention import selector
from tinyvllm.attention.torch_ref import TorchAttentionBackend
from tinyvllm.kernels.cpu import cpu_kernels
from tinyvllm.model.dummy import save_word_level_tokenizer
from tinyvllm.model.weights import load_model

HAS_KERNELS = cpu_kernels() is not None
VOCAB = 128
PROMPTS = [[3 + (7 * i + 5 * j) % (VOCAB - 3) for j in range(n)] for i, n in enumerate([5, 13, 22, 1])]
ENGINE = dict(block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=96, max_model_len=128)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama_backends")
    make_tiny_llama(path, vocab=VOCAB, hidden=64, layers=2, num_heads=4, num_kv_heads=2)
    save_word_level_tokenizer(path, VOCAB)
    return path


def _greedy(llm, prompts):
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    return [list(o.outputs[0].token_ids) for o in llm.generate([{"prompt_token_ids": p} for p in prompts], sp)]


@pytest.mark.parametrize("env,dtype,expected", [
    (None, torch.bfloat16, "cpu"), (None, torch.float32, "cpu"), ("cpu", torch.float32, "cpu"),
    ("cpp", torch.bfloat16, "cpu"), ("torch", torch.bfloat16, "torch"), ("torch", torch.float32, "torch"),
    (None, torch.float16, "torch"),  # the C++ kernels are for bf16/fp32 only
])
def test_selector_rules(monkeypatch, env, dtype, expected):
    if env is None:
        monkeypatch.delenv("TINYVLLM_ATTENTION", raising=False)
    else:
        monkeypatch.setenv("TINYVLLM_ATTENTION", env)
    if expected == "cpu" and not HAS_KERNELS:
        expected = "torch"
    assert selector.get_attn_backend(torch.device("cpu"), dtype).name == expected


def test_only_the_cpu_backend_packs_and_binding_twice_is_harmless(tiny_dir, monkeypatch):
    monkeypatch.setenv("TINYVLLM_ATTENTION", "torch")
    m = load_model(tiny_dir, torch.bfloat16)
    m.bind_attn_backend(selector.get_attn_backend("cpu", torch.bfloat16))
    assert isinstance(m.attn_backend, TorchAttentionBackend) and not m.packed  # torch: no C++ at all
    kern = cpu_kernels()
    if kern is None or not kern.gemm_has_bf16_kernel():
        pytest.skip("bf16 GEMM kernel not built on this CPU: weights stay unpacked")
    monkeypatch.delenv("TINYVLLM_ATTENTION")
    with pytest.raises(ValueError, match="already runs"):  # engines sharing a model share its backend
        m.bind_attn_backend(selector.get_attn_backend("cpu", torch.bfloat16))
    assert isinstance(m.attn_backend, TorchAttentionBackend) and not m.packed
    m = load_model(tiny_dir, torch.bfloat16)
    m.bind_attn_backend(selector.get_attn_backend("cpu", torch.bfloat16))
    assert m.packed
    first = m.lm_head.packed
    m.bind_attn_backend(selector.get_attn_backend("cpu", torch.bfloat16))  # a second engine on the same model
    assert m.lm_head.packed is first  # packed once
    with pytest.raises(ValueError, match="already runs"):
        m.bind_attn_backend(TorchAttentionBackend("cpu"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cpu_and_torch_backends_give_the_same_greedy_tokens(tiny_dir, monkeypatch, dtype):
    """Each backend: batched == one at a time, and a second round (prefix-cache hits) == the first;
    and the C++ backend's tokens == the PyTorch float64 reference's."""
    results = {}
    for name in ("cpu", "torch"):
        if name == "cpu" and not HAS_KERNELS:
            continue
        monkeypatch.setenv("TINYVLLM_ATTENTION", name)
        llm = LLM(model=str(tiny_dir), dtype=dtype, **ENGINE)
        assert llm.llm_engine.core.runner.attn_backend.name == name
        batched = _greedy(llm, PROMPTS)
        assert _greedy(llm, PROMPTS) == batched  # prefix-cache hits
        assert llm.llm_engine.core.stats()["prefix_cache_hits"] > 0
        assert [_greedy(llm, [p])[0] for p in PROMPTS] == batched
        results[name] = batched
    if len(results) == 2:
        assert results["cpu"] == results["torch"]


def test_backend_is_chosen_once_per_engine(tiny_dir, monkeypatch):
    calls = []
    real = selector.get_attn_backend
    from tinyvllm.worker import model_runner

    def counted(*a, **k):
        calls.append(a)
        return real(*a, **k)

    monkeypatch.setattr(model_runner, "get_attn_backend", counted)
    llm = LLM(model=str(tiny_dir), dtype="float32", **ENGINE)
    assert len(calls) == 1

    def fail(*a, **k):
        raise AssertionError("backend selected or kernels loaded during a step")

    monkeypatch.setattr(model_runner, "get_attn_backend", fail)
    monkeypatch.setattr(selector, "get_attn_backend", fail)
    monkeypatch.setattr(selector, "cpu_kernels", fail)
    assert len(_greedy(llm, PROMPTS)) == len(PROMPTS)
