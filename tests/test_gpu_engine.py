"""The GPU path end to end: device selection, the Triton attention backend inside
the whole engine, and CUDA graphs of the decode step.

* On a machine without CUDA (CI): the engine with ``TINYVLLM_ATTENTION=triton``
  runs the Triton kernels on the CPU under the interpreter
  (``TRITON_INTERPRET=1``) and must give the default CPU path's greedy tokens;
  the padded static-buffer decode forward of the CUDA-graph runner (run eagerly)
  must match the plain forward and leave every KV slot but the real ones alone.
* On CUDA (``scripts/gpu_check.sh``): the engine on ``cuda`` in float32, eager
  and with CUDA graphs, must give the CPU float32 greedy tokens.

Everything uses a tiny random-weight Llama (``tests/tiny_models.py``) with a
small word-level tokenizer, so it is fast even in the interpreter.
"""

from __future__ import annotations

import argparse
import importlib
import os
from pathlib import Path

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first ``import triton``

from tiny_models import make_tiny_llama  # noqa: E402

from tinyvllm import SamplingParams  # noqa: E402
from tinyvllm.attention.selector import get_attn_backend  # noqa: E402
from tinyvllm.model.dummy import save_word_level_tokenizer  # noqa: E402

VOCAB = 128


def _triton_kernels(interpret: bool):
    """The kernels module, compiled for CUDA or interpreted on the CPU (reloaded if it was imported the other way)."""
    pytest.importorskip("triton")
    import tinyvllm.kernels.triton.attention as tk

    if tk._interpreting() != interpret:
        if interpret and not HAS_CUDA:
            tk = importlib.reload(tk)  # TRITON_INTERPRET=1 is set above
            import tinyvllm.kernels.triton.ops as tops

            importlib.reload(tops)  # the fused RMSNorm / RoPE kernels, likewise
        else:
            pytest.skip(f"Triton kernels are {'interpreted' if tk._interpreting() else 'compiled'} in this process "
                        f"(TRITON_INTERPRET={os.environ.get('TRITON_INTERPRET')!r})")
    return tk


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny_llama_gpu")
    make_tiny_llama(path, vocab=VOCAB, hidden=64, layers=2, num_heads=4, num_kv_heads=2)
    save_word_level_tokenizer(path, VOCAB)
    return path


# Three prompts (one longer than the 16-token step budget, so it is chunked), then the same
# prompts again: the second round reads their full blocks from the prefix cache.
PROMPTS = [[3 + (7 * i + 5 * j) % (VOCAB - 3) for j in range(n)] for i, n in enumerate([5, 13, 22])]
ENGINE = dict(dtype="float32", block_size=4, max_num_batched_tokens=16, max_num_seqs=4, num_kv_blocks=64,
              max_model_len=128)


def _generate(llm, prompts=PROMPTS, max_tokens=6, logprobs=None):
    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp)
    return [o.outputs[0] for o in outs]


def _run_rounds(llm, rounds=2):
    toks, lps = [], []
    for _ in range(rounds):
        for c in _generate(llm, logprobs=3):
            toks.append(list(c.token_ids))
            lps.append([{t: lp.logprob for t, lp in d.items()} for d in c.logprobs])
    return toks, lps


def _assert_logprobs_close(lps, ref_lps, atol=1e-4):
    for seq, ref_seq in zip(lps, ref_lps, strict=True):
        for d, r in zip(seq, ref_seq, strict=True):
            assert d.keys() == r.keys(), (d, r)
            assert all(abs(d[t] - r[t]) <= atol for t in d), (d, r)


# ---------------------------------------------------------------------------------------- CPU (CI)


def test_device_resolution_and_flags():
    from tinyvllm.config import EngineArgs, ModelConfig, resolve_device

    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    with pytest.raises(ValueError, match="device"):
        ModelConfig(device="tpu")
    if not HAS_CUDA:
        with pytest.raises(ValueError, match="no CUDA device"):
            resolve_device("cuda")
    p = argparse.ArgumentParser()
    EngineArgs.add_cli_args(p)
    kw = EngineArgs.from_cli_args(p.parse_args(["--device", "cpu", "--enforce-eager"]))
    assert kw.device == "cpu" and kw.enforce_eager is True
    kw = EngineArgs.from_cli_args(p.parse_args([]))
    assert kw.device == "auto" and kw.enforce_eager is False


@pytest.mark.skipif(HAS_CUDA, reason="checks the message for a machine without CUDA")
def test_cli_cuda_without_cuda_is_one_clear_line(capsys):
    from tinyvllm.entrypoints.cli import main

    assert main(["generate", "hi", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: device 'cuda' requested but torch sees no CUDA device") and "Traceback" not in err
    assert main(["generate", "hi", "--device", "tpu"]) == 2
    assert "device must be" in capsys.readouterr().err


def test_resolve_device_cuda_is_always_indexed(monkeypatch):
    """``torch.cuda.set_device`` rejects a bare ``torch.device("cuda")``: resolution names the index."""
    from tinyvllm.config import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)  # no CUDA context made just to resolve
    monkeypatch.setattr(torch.cuda, "current_device", lambda: pytest.fail("initialised CUDA"))
    assert resolve_device("cuda") == torch.device("cuda", 0)
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(ValueError, match="only 2 CUDA device"):
        resolve_device("cuda:2")


def test_model_runner_sets_an_indexed_cuda_device(tiny_dir, monkeypatch):
    """``torch.cuda.set_device`` rejects a bare ``torch.device("cuda")``; the runner always passes an index."""
    from tinyvllm.model.weights import load_model
    from tinyvllm.worker.model_runner import ModelRunner

    seen = []

    class Stop(Exception):
        pass

    def set_device(dev):
        seen.append(dev)
        raise Stop  # no CUDA here: stop before the KV cache is allocated

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    model = load_model(tiny_dir, torch.float32, "cpu")
    for device in ("cuda", torch.device("cuda"), "cuda:1"):
        with pytest.raises(Stop):
            ModelRunner(model, 8, 4, torch.float32, device)
    assert [d.index for d in seen] == [0, 0, 1] and all(d.type == "cuda" for d in seen)


def test_cpu_engine_has_no_cuda_graphs(tiny_dir):
    from tinyvllm import LLM

    llm = LLM(model=str(tiny_dir), device="auto" if not HAS_CUDA else "cpu", **ENGINE)
    core = llm.llm_engine.core
    assert core.device == torch.device("cpu")
    assert core.runner.graph_runner is None  # CUDA graphs are CUDA-only, whatever enforce_eager says


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter variant runs on CPU-only machines; CUDA runs the native tests")
def test_engine_triton_interpreter_matches_cpu_path(tiny_dir, monkeypatch):
    """The whole engine with the Triton backend (interpreted on the CPU: paged attention, KV store, fused
    RMSNorm+residual and RoPE) gives the CPU path's greedy tokens: chunked prefill, mixed prefill+decode
    steps, decode-only steps and prefix-cache hits."""
    from tinyvllm import LLM

    tk = _triton_kernels(interpret=True)
    ref_toks, ref_lps = _run_rounds(LLM(model=str(tiny_dir), **ENGINE))

    import tinyvllm.kernels.triton.ops as tops

    calls = {"decode": 0, "prefill": 0, "rms_norm": 0, "rotary": 0}
    for mod, name, key in ((tk, "paged_decode_attention", "decode"), (tk, "paged_prefill_attention", "prefill"),
                           (tops, "rms_norm", "rms_norm"), (tops, "rotary_embedding", "rotary")):
        orig = getattr(mod, name)

        def counted(*a, _orig=orig, _key=key, **k):
            calls[_key] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(mod, name, counted)
    monkeypatch.setenv("TINYVLLM_ATTENTION", "triton")
    llm = LLM(model=str(tiny_dir), **ENGINE)
    toks, lps = _run_rounds(llm)
    assert calls["decode"] > 0 and calls["prefill"] > 0
    assert calls["rms_norm"] > 0 and calls["rotary"] > 0  # the fused Triton RMSNorm and RoPE run in the model
    assert llm.llm_engine.core.stats()["prefix_cache_hits"] > 0
    assert toks == ref_toks
    _assert_logprobs_close(lps, ref_lps)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter variant runs on CPU-only machines; CUDA runs the native tests")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_triton_backend_stores_the_quantized_rows_and_attends_like_the_torch_backend(monkeypatch, kind):
    """The Triton backend's ``attention`` on an int8/fp8 cache (interpreted): the K/V bytes it stores are
    ``kv_quant.quantize``'s, in the right slots, and its output equals the PyTorch reference backend's on the
    same cache and inputs (a prefill chunk after a cached prefix, then a decode step)."""
    from tinyvllm.attention import kv_quant
    from tinyvllm.attention.torch_ref import TorchAttentionBackend
    from tinyvllm.model.layers import RotaryEmbedding

    _triton_kernels(interpret=True)
    monkeypatch.setenv("TINYVLLM_ATTENTION", "triton")
    tb = get_attn_backend("cpu", torch.float32)
    assert tb.name == "triton"
    rb = TorchAttentionBackend("cpu")
    h, hk, d, bs, nb = 4, 2, 16, 4, 8
    g = torch.Generator().manual_seed(3)
    elem, extra = kv_quant.kv_storage(kind, torch.float32)
    caches = [torch.zeros(2, nb, bs, hk, d + extra, dtype=elem) for _ in range(2)]
    tables = [[5, 1, 6], [2, 7, 0]]
    for query_lens, seq_lens in (([7, 6], [7, 6]), ([4, 2], [11, 8]), ([1, 1], [12, 9])):
        T = sum(query_lens)
        qkv = torch.randn(T, (h + 2 * hk) * d, generator=g)
        positions = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)])
        outs = []
        for be, cache in ((tb, caches[0]), (rb, caches[1])):
            md = be.build_metadata(query_lens, seq_lens, tables, bs)
            rope = be.rope_inputs(RotaryEmbedding(d, 64, 10000.0), positions)
            outs.append(be.attention(qkv.clone(), cache, md, rope, h, hk, d, d**-0.5))
        assert torch.equal(caches[0], caches[1])  # the same bytes: kv_quant.quantize's, in the same slots
        torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)
    assert kv_quant.quantization_of(caches[0]) == kind


@pytest.mark.slow
@pytest.mark.skipif(HAS_CUDA, reason="the interpreter variant runs on CPU-only machines; CUDA runs the native tests")
@pytest.mark.parametrize("kind", ["int8", "fp8"])
def test_engine_triton_interpreter_quantized_kv_matches_torch_backend(tiny_dir, monkeypatch, kind):
    """``--kv-cache-dtype int8|fp8`` on the Triton backend (interpreted): the backend quantizes each step's
    K/V rows to the bytes the other backends store and the kernels attend over them, so greedy tokens and
    logprobs equal the PyTorch reference backend's on the same cache format (chunked prefill, mixed and
    decode-only steps, prefix-cache hits)."""
    from tinyvllm import LLM
    from tinyvllm.attention import kv_quant

    tk = _triton_kernels(interpret=True)
    monkeypatch.setenv("TINYVLLM_ATTENTION", "torch")
    ref_toks, ref_lps = _run_rounds(LLM(model=str(tiny_dir), kv_cache_dtype=kind, **ENGINE))
    calls = {"prefill": 0}
    orig = tk.paged_prefill_attention

    def counted(q, key_cache, *a, **k):
        assert kv_quant.quantization_of(key_cache) == kind
        calls["prefill"] += 1
        return orig(q, key_cache, *a, **k)

    monkeypatch.setattr(tk, "paged_prefill_attention", counted)
    monkeypatch.setenv("TINYVLLM_ATTENTION", "triton")
    llm = LLM(model=str(tiny_dir), kv_cache_dtype=kind, **ENGINE)
    assert llm.llm_engine.core.runner.attn_backend.name == "triton"
    toks, lps = _run_rounds(llm)
    assert calls["prefill"] > 0 and llm.llm_engine.core.stats()["prefix_cache_hits"] > 0
    assert toks == ref_toks
    _assert_logprobs_close(lps, ref_lps)


def _decode_batch():
    """Three sequences with non-contiguous block tables, one decode token each."""
    tables = [[5, 2, 9], [7], [1, 11, 3, 8]]
    seq_lens = [10, 3, 15]
    positions = [s - 1 for s in seq_lens]
    input_ids = [11, 42, 99]
    return input_ids, positions, seq_lens, tables


def _random_kv(model, num_blocks, block_size, seed=0):
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, block_size, cfg.num_key_value_heads, cfg.head_dim, generator=g)
            for _ in range(cfg.num_hidden_layers)]


def _eager_decode(model, kv, input_ids, positions, seq_lens, tables, block_size, device):
    md = model.attn_backend.build_metadata([1] * len(input_ids), seq_lens, tables, block_size)
    with torch.inference_mode():
        return model(torch.tensor(input_ids, device=device), torch.tensor(positions, device=device), kv, md)


def _check_graph_runner_padding(model, device, use_graphs: bool):
    """Padded static-buffer decode == plain decode; KV changes only at the real tokens' slots."""
    from tinyvllm.worker.cuda_graph import DecodeGraphRunner

    bsz, nblocks = 4, 16
    ids, pos, lens, tables = _decode_batch()
    kv0 = [t.to(device) for t in _random_kv(model, nblocks, bsz)]
    kv_ref = [t.clone() for t in kv0]
    ref = _eager_decode(model, kv_ref, ids, pos, lens, tables, bsz, device)

    kv = [t.clone() for t in kv0]
    runner = DecodeGraphRunner(model, kv, bsz, max_num_seqs=8, max_model_len=64, device=device,
                               use_graphs=use_graphs, sizes=(1, 2, 4, 8))
    if use_graphs:
        assert runner.capture(), "CUDA graph capture failed (see the log for the host sync that blocks it)"
        assert sorted(runner.graphs) == [1, 2, 4, 8]
    # One unrelated wider batch first, so the static buffers hold stale rows and columns.
    with torch.inference_mode():
        runner.run([1] * 8, [20] * 8, [21] * 8, [[0, 1, 2, 3, 4, 5]] * 8)
    for t, t0 in zip(kv, kv0):  # undo that batch's stores
        t.copy_(t0)
    with torch.inference_mode():
        out = runner.run(ids, pos, lens, tables).clone()  # 3 sequences padded to 4
    assert out.shape == ref.shape
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    real_slots = {t[p // bsz] * bsz + p % bsz for t, p in zip(tables, pos)}
    for a, r, a0 in zip(kv, kv_ref, kv0):
        torch.testing.assert_close(a, r, atol=1e-6, rtol=1e-6)  # same new K/V as the plain path
        changed = (a != a0).reshape(2, nblocks * bsz, -1).any(-1).any(0).nonzero().flatten().tolist()
        assert set(changed) <= real_slots
    # A single sequence (size 1) after the 3-sequence step: stale rows 1..3 must not matter.
    with torch.inference_mode():
        one = runner.run(ids[:1], pos[:1], lens[:1], tables[:1]).clone()
    torch.testing.assert_close(one, ref[:1], atol=2e-5, rtol=2e-5)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter variant runs on CPU-only machines")
def test_decode_graph_runner_padding_on_cpu(tiny_dir, monkeypatch):
    """The CUDA-graph runner's padded static-buffer forward, run eagerly on the CPU (Triton interpreter)."""
    from tinyvllm.model.weights import load_model

    _triton_kernels(interpret=True)
    monkeypatch.setenv("TINYVLLM_ATTENTION", "triton")
    model = load_model(tiny_dir, torch.float32, "cpu")
    model.bind_attn_backend(get_attn_backend("cpu", torch.float32))  # the Triton backend (interpreted)
    assert model.attn_backend.name == "triton"
    _check_graph_runner_padding(model, torch.device("cpu"), use_graphs=False)


# ---------------------------------------------------------------------------------------- CUDA only

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (run scripts/gpu_check.sh there)")


@cuda_only
def test_cuda_graph_runner_padding(tiny_dir):
    from tinyvllm.model.weights import load_model

    _triton_kernels(interpret=False)
    model = load_model(tiny_dir, torch.float32, "cuda")
    device = torch.device("cuda", torch.cuda.current_device())
    model.bind_attn_backend(get_attn_backend(device, torch.float32))
    _check_graph_runner_padding(model, device, use_graphs=True)


@pytest.fixture(scope="module")
def cpu_reference(tiny_dir):
    from tinyvllm import LLM

    return _run_rounds(LLM(model=str(tiny_dir), device="cpu", **ENGINE))


@cuda_only
@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs_small"])
def test_cuda_engine_matches_cpu(tiny_dir, cpu_reference, mode, monkeypatch):
    """float32 on CUDA (eager; CUDA graphs; graphs only for batches <= 2, so 3-4 fall back to eager)
    gives the CPU float32 greedy tokens, and logprobs within 1e-4."""
    from tinyvllm import LLM
    from tinyvllm.worker import cuda_graph

    _triton_kernels(interpret=False)
    if mode == "graphs_small":
        monkeypatch.setattr(cuda_graph, "CAPTURE_SIZES", (1, 2))
    llm = LLM(model=str(tiny_dir), device="cuda", enforce_eager=(mode == "eager"), **ENGINE)
    runner = llm.llm_engine.core.runner
    assert runner.kv_caches[0].is_cuda
    if mode == "eager":
        assert runner.graph_runner is None
    else:
        assert runner.graph_runner is not None, "CUDA graph capture failed (see the log)"
        assert runner.graph_runner.sizes == ([1, 2, 4] if mode == "graphs" else [1, 2])
    toks, lps = _run_rounds(llm)
    ref_toks, ref_lps = cpu_reference
    assert toks == ref_toks
    _assert_logprobs_close(lps, ref_lps)


@cuda_only
def test_cuda_seeded_sampling_is_reproducible(tiny_dir):
    """A seeded request's generator lives on the GPU; the same seed gives the same tokens, alone or batched."""
    from tinyvllm import LLM

    _triton_kernels(interpret=False)
    llm = LLM(model=str(tiny_dir), device="cuda", **ENGINE)
    sp = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=8, seed=1234, ignore_eos=True)
    alone = llm.generate([{"prompt_token_ids": PROMPTS[1]}], sp)[0].outputs[0].token_ids
    batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp)[1].outputs[0].token_ids
    assert list(alone) == list(batched)
