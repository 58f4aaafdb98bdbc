"""Start-up: the prepared-weights cache (never stale, never partial, identical outputs), the CPU
kernels' direct import of an existing build, and ``tinyvllm serve``'s early spawn (the API process
imports no torch; SIGTERM during start-up still stops both processes in order)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tiny_models import make_tiny_llama
import tinyvllm.model.weights as W

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    # The C++ kernels are loaded (once per process) before the cache moves: the first engine of a session
    # built with an empty TINYVLLM_CACHE would build them again there (~2 min on 2 cores), which a random
    # order that runs this module first used to pay.
    from tinyvllm.kernels.cpu import cpu_kernels

    cpu_kernels()
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(W, "PREPARED_MIN_BYTES", 0)  # the tiny model is cached too
    return tmp_path / "cache"


def _state(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prepared_weights_equal_the_source_and_are_written_once(tmp_path, cache, dtype):
    src = make_tiny_llama(tmp_path / "m")
    path, _ = W.prepared_weights_path(src, dtype)
    assert not path.exists()
    first = W.load_model(src, dtype)
    assert path.is_file() and not list(path.parent.glob(".prepared-*")), "no temp file left behind"
    mtime = path.stat().st_mtime_ns
    again = W.load_model(src, dtype)  # from the mapped file
    assert path.stat().st_mtime_ns == mtime, "a valid prepared file is not rewritten"
    a, b = _state(first), _state(again)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype == dtype for k in a)
    assert torch.equal(first.rotary.inv_freq, again.rotary.inv_freq)


def test_prepared_cache_gives_identical_greedy_tokens(tmp_path, cache):
    from tinyvllm import LLM, SamplingParams

    from tinyvllm.model.dummy import save_word_level_tokenizer

    src = make_tiny_llama(tmp_path / "m", vocab=128)
    save_word_level_tokenizer(src, 128)
    kw = dict(model=str(src), dtype="bfloat16", device="cpu", block_size=4, num_kv_blocks=64)
    prompts = [{"prompt_token_ids": [3, 17, 42, 5, 99, 1, 7]}, {"prompt_token_ids": [8, 9]}]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    path, _ = W.prepared_weights_path(src, torch.bfloat16)
    uncached = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp)]
    assert path.is_file()
    cached = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, sp)]
    assert cached == uncached


def test_stale_or_corrupt_prepared_weights_are_ignored_and_rebuilt(tmp_path, cache):
    src = make_tiny_llama(tmp_path / "m")
    ref = _state(W.load_model(src, torch.float32))
    path, key = W.prepared_weights_path(src, torch.float32)

    # A changed source file gives another key (another file): the old one is never read.
    st = (src / "model.safetensors").stat()
    os.utime(src / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    path2, key2 = W.prepared_weights_path(src, torch.float32)
    assert key2 != key and path2 != path

    # Corrupt (truncated / garbage) file at the right name: ignored, the source is loaded, the file rewritten.
    for junk in (b"", b"garbage" * 10, path.read_bytes()[: path.stat().st_size // 2]):
        path2.parent.mkdir(parents=True, exist_ok=True)
        path2.write_bytes(junk)
        got = _state(W.load_model(src, torch.float32))
        assert all(torch.equal(ref[k], got[k]) for k in ref)
        assert W._load_prepared(path2, key2, got) is not None, "rewritten"

    # A well-formed file with another key, or other tensors, is not used either.
    from safetensors.torch import save_file

    bad = {k: torch.zeros_like(v) for k, v in ref.items()}
    save_file(bad, str(path2), metadata={W._KEY_META: "not-the-key"})
    got = _state(W.load_model(src, torch.float32))
    assert all(torch.equal(ref[k], got[k]) for k in ref)
    save_file({k: v for k, v in list(bad.items())[1:]}, str(path2), metadata={W._KEY_META: key2})
    got = _state(W.load_model(src, torch.float32))
    assert all(torch.equal(ref[k], got[k]) for k in ref)


def test_small_sources_are_not_cached(tmp_path, monkeypatch):
    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path / "cache"))
    src = make_tiny_llama(tmp_path / "m")
    W.load_model(src, torch.float32)
    assert not (tmp_path / "cache" / "weights").exists()


def test_cpu_kernels_import_an_existing_build_directly(monkeypatch):
    import tinyvllm.kernels.cpu as K

    kern = K.cpu_kernels()
    if kern is None:
        pytest.skip("the C++ kernels cannot be built here")
    build = Path(kern.__file__).parent
    assert (build / K._BUILT_MARKER).read_text() == kern.__name__
    assert K._load_built(build, kern.__name__) is not None
    assert K._load_built(build, "tinyvllm_cpu_kernels_other") is None  # marker names another build


def test_serve_spawns_the_core_before_the_api_process_imports_torch_or_the_server():
    code = ("import sys\n"
            "from tinyvllm.entrypoints.openai import launcher\n"
            "from tinyvllm.engine import async_llm\n"
            "from tinyvllm.model.loader import resolve_model\n"
            "d = resolve_model('SmolLM2-135M-Instruct').model_dir\n"
            "heavy = {'torch', 'numpy', 'transformers', 'tokenizers', 'fastapi', 'uvicorn', 'prometheus_client'}\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & heavy)\n"
            "assert not bad, ('imported before the core is spawned', bad)\n"
            "from tinyvllm.engine.tokenizer import load_tokenizer\n"
            "load_tokenizer(d)\n"
            "bad = sorted({m.split('.')[0] for m in sys.modules} & {'torch'})\n"
            "assert not bad, ('the API process needs no torch', bad)\n")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


def test_sigterm_during_start_up_stops_both_processes(tmp_path):
    log = tmp_path / "serve.log"
    with open(log, "w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--port",
                                 "0"], cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while "engine core process started (pid" not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.02)
        text = log.read_text()
        core_pid = int(text.split("engine core process started (pid ")[1].split(")")[0])
        proc.send_signal(signal.SIGTERM)  # the core is loading, the API process importing
        assert proc.wait(30) == 0, log.read_text()[-2000:]
        for _ in range(100):
            try:
                os.kill(core_pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.05)
        else:
            pytest.fail(f"engine core {core_pid} outlived the server")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_python_m_tinyvllm_model_prepares_the_weights_ahead(tmp_path, cache, capsys):
    """``make test``'s set-up step (``python -m tinyvllm.model``) leaves the prepared weights the first engine
    start would write; an unknown model is one line and exit code 1."""
    from tinyvllm.model.__main__ import main

    src = make_tiny_llama(tmp_path / "m")
    assert main([str(src), "--dtype", "float32", "bfloat16"]) == 0
    for dtype in (torch.float32, torch.bfloat16):
        assert W.prepared_weights_path(src, dtype)[0].is_file()
    capsys.readouterr()
    assert main([str(tmp_path / "missing")]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"cannot prepare {str(tmp_path / 'missing')!r}: unknown model"), err
