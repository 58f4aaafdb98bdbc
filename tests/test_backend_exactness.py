"""The engine-level exactness tests once more on each attention backend that this machine would not
otherwise run: greedy outputs are identical whatever the batching, chunking, prefix-cache state or
preemption history.

The default backend here is the C++ one (tests/test_engine.py covers it). ``torch`` is the pure-PyTorch
reference path that a machine without the C++ build (or without AVX512-BF16) runs: float64
attention, HF-style RMSNorm, unpacked ``F.linear`` weights. The model is loaded again for each backend
(a model bound to one backend refuses another).

The default tier runs the torch backend on a tiny random Llama (bf16, the same code path: float64
attention, HF-style RMSNorm, unpacked linears; ~1 s); the SmolLM2 run of the same checks (~24 s) is in
the slow tier."""

from __future__ import annotations

import random

import pytest

from tinyvllm import LLM, SamplingParams

from conftest import CHAT_PROMPTS, assert_no_kv_leak

MAX_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
TINY_VOCAB = 512
# (backend, model): "tiny" is a random 2-layer Llama written to a temp dir, "smol" the embedded SmolLM2.
CASES = [pytest.param(("torch", "tiny"), id="torch-tiny"),
         pytest.param(("torch", "smol"), id="torch", marks=pytest.mark.slow)]


@pytest.fixture(scope="module", params=CASES)
def backend_llm(request, tmp_path_factory):
    backend, which = request.param
    mp = pytest.MonkeyPatch()
    mp.setenv("TINYVLLM_ATTENTION", backend)
    if which == "tiny":
        from tiny_models import make_tiny_llama

        from tinyvllm.model.dummy import save_word_level_tokenizer

        path = tmp_path_factory.mktemp("tiny_torch_backend")
        make_tiny_llama(path, vocab=TINY_VOCAB, hidden=64, layers=2, num_heads=4, num_kv_heads=2)
        save_word_level_tokenizer(path, TINY_VOCAB)
        model = str(path)
    else:
        model = "SmolLM2-135M-Instruct"
    made = []

    def make(**kw):
        llm = LLM(model, dtype="bfloat16",
                  _preloaded_model=made[0].llm_engine.core.model if made else None, **kw)
        made.append(llm)
        return llm

    base = make()
    assert type(base.llm_engine.core.runner.attn_backend).__name__.lower().startswith(backend)
    yield base, make
    mp.undo()


def _prompts(llm):
    rng = random.Random(1)
    if llm.llm_engine.core.model.config.vocab_size == TINY_VOCAB:
        ids = [[rng.randrange(3, TINY_VOCAB) for _ in range(rng.randrange(20, 90))] for _ in range(8)]
    else:
        ids = [llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in CHAT_PROMPTS[:4]]
        ids += [[rng.randrange(100, 40000) for _ in range(rng.randrange(20, 90))] for _ in range(4)]
    return [{"prompt_token_ids": p} for p in ids]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_backend_outputs_invariant(backend_llm):
    base, make = backend_llm
    prompts = _prompts(base)
    alone = [_tokens(base.generate(p, GREEDY))[0] for p in prompts]
    assert len({tuple(t) for t in alone}) == len(alone)  # distinct prompts, distinct continuations
    assert _tokens(base.generate(prompts, GREEDY)) == alone, "batched != one at a time"
    assert _tokens(base.generate(prompts, GREEDY)) == alone, "prefix-cache hits changed the outputs"
    assert base.stats()["cached_prompt_tokens"] > 0  # the repeats were served from the prefix cache
    chunked = make(max_num_batched_tokens=32)
    assert _tokens(chunked.generate(prompts, GREEDY)) == alone, "chunked prefill changed the outputs"
    tight = make(num_kv_blocks=9, enable_prefix_caching=False)
    assert _tokens(tight.generate(prompts, GREEDY)) == alone, "preemption changed the outputs"
    assert tight.stats()["num_preemptions"] > 0
    for llm in (base, chunked, tight):
        assert_no_kv_leak(llm)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_fallback_linear_rows_independent_of_batch(dtype):
    """``batch_invariant_linear`` (the unpacked linear of the fallback and fp32 paths): a row's result
    is the same whatever M and wherever the row sits in the batch, for SmolLM2's projection shapes
    (plain ``F.linear`` fails this on this machine: see the function's docstring)."""
    import torch

    from tinyvllm.model.llama import batch_invariant_linear

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    for n, k in [(960, 576), (3072, 576), (576, 1536), (576, 576)]:
        w, x = torch.randn(n, k).to(dt), torch.randn(300, k).to(dt)
        ref = torch.cat([batch_invariant_linear(x[i:i + 1], w) for i in range(40)])
        for m in (2, 5, 16, 17, 33, 90, 300):
            assert torch.equal(batch_invariant_linear(x[:m], w)[:40], ref[:min(m, 40)])
        for shift in (1, 7):  # the same rows behind other rows
            y = batch_invariant_linear(torch.cat([x[300 - shift:], x[:120]]), w)[shift:shift + 40]
            assert torch.equal(y, ref)
