"""A first start that says what it is doing (issue 42): ``tinyvllm --version``; a port in use, a missing model
path and a model directory without ``config.json`` each as one line naming the problem (no traceback); each long
first-run step announced with a timed line; and the ready line's dtype, quantization and KV capacity in tokens.

The default tier starts one small server (a dummy-weight model, the kernel build reused); the full first start on
an empty cache (GGUF conversion, kernel build, prepared weights: minutes) is ``@pytest.mark.slow``.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "tinyvllm.entrypoints.cli"]


def test_version_prints_the_package_version(capsys):
    from tinyvllm.entrypoints import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    want = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert capsys.readouterr().out.strip() == f"tinyvllm {want}"


def _one_error_line(cmd: list[str], code: int) -> str:
    """Run ``tinyvllm ...``: exit code ``code``, no traceback, exactly one error line (returned)."""
    r = subprocess.run([*CLI, *cmd], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    out = r.stdout + r.stderr
    assert r.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if " ERROR " in ln or ln.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


def test_port_in_use_is_one_line():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_error_line(["serve", "--port", str(port)], 1)
    assert f"cannot listen on 127.0.0.1:{port}: address already in use (--port)" in line, line


def test_missing_model_path_is_one_line(tmp_path):
    missing = tmp_path / "no_such_model"
    line = _one_error_line(["serve", "--port", "0", "--model", str(missing)], 2)
    assert f"unknown model {str(missing)!r}" in line and "--model" in line, line


def test_model_directory_without_config_json_is_one_line(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    line = _one_error_line(["serve", "--port", "0", "--model", str(tmp_path)], 2)
    assert f"model directory {str(tmp_path)!r} has no config.json" in line, line


# ----------------------------------------------------------------------------- announcements and the ready line

SERVE_LINE = re.compile(r"serving (\S+) on http://127\.0\.0\.1:(\d+) \((\w+), quantization (\w+), "
                        r"KV cache (\d+) tokens, max_model_len (\d+); engine core pid \d+\)")


def _serve_until_ready(args: list[str], env: dict[str, str], log: Path, timeout: float) -> str:
    """Start ``tinyvllm serve ARGS``, wait for its ready line, stop it with SIGINT; return its whole log."""
    with open(log, "wb") as fh:
        proc = subprocess.Popen([*CLI, "serve", "--port", "0", *args], stdout=fh, stderr=subprocess.STDOUT,
                                env=dict(os.environ, TOKENIZERS_PARALLELISM="false", **env))
    try:
        import time

        deadline = time.monotonic() + timeout
        while not SERVE_LINE.search(log.read_text(errors="replace")):
            assert proc.poll() is None, log.read_text(errors="replace")[-4000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-4000:]
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, log.read_text(errors="replace")[-4000:]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
    return log.read_text(errors="replace")


def _fresh_cache_with_kernels(tmp: Path) -> Path:
    """An empty ``TINYVLLM_CACHE`` that shares only the C++ kernel build of the default cache (a build is
    minutes; it is announced and checked by the slow test below)."""
    from tinyvllm import envs
    from tinyvllm.kernels.cpu import cpu_kernels

    assert cpu_kernels() is not None  # builds into the default cache if this checkout has no build yet
    cache = tmp / "cache"
    cache.mkdir()
    (cache / "torch_extensions").symlink_to(envs.TINYVLLM_CACHE / "torch_extensions", target_is_directory=True)
    return cache


def test_ready_line_names_dtype_quantization_and_kv_capacity(tmp_path):
    """The ready line's KV capacity is the pool's: kv-cache-memory // (bytes of one block), in tokens, from the
    config's shape (2 x layers x KV heads x head_dim x 2 bytes per token in bfloat16); weights packed on a fresh
    start are announced with their time."""
    from tinyvllm.model.dummy import write_dummy_model_dir

    layers, kv_heads, head_dim, block = 2, 2, 16, 16
    model = write_dummy_model_dir(tmp_path / "model", {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": layers, "num_attention_heads": 4,
        "num_key_value_heads": kv_heads, "head_dim": head_dim, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True, "bos_token_id": 1,
        "eos_token_id": 2})
    mem = 1 << 20
    out = _serve_until_ready(["--model", str(model), "--load-format", "dummy", "--dtype", "bfloat16",
                              "--block-size", str(block), "--kv-cache-memory", str(mem)],
                             {"TINYVLLM_CACHE": str(_fresh_cache_with_kernels(tmp_path))}, tmp_path / "serve.log",
                             timeout=120)
    m = SERVE_LINE.search(out)
    block_bytes = 2 * layers * kv_heads * head_dim * 2 * block
    assert m.group(1) == "model" and m.group(3) == "bfloat16" and m.group(4) == "none", m.group(0)
    assert int(m.group(5)) == mem // block_bytes * block, m.group(0)
    assert int(m.group(6)) == 512, m.group(0)
    from tinyvllm.kernels.cpu import cpu_kernels

    if cpu_kernels().gemm_has_bf16_kernel():  # bf16 linears run on packed weights (AVX512-BF16)
        assert re.search(r"packed the linear weights for the \w+ backend's GEMM in \d+\.\d+s", out), out[-3000:]
    assert "Traceback" not in out


@pytest.mark.slow
def test_first_start_on_an_empty_cache_announces_each_long_step(tmp_path):
    """``make serve`` on an empty cache: the GGUF conversion, the C++ kernel build and the prepared weights
    are each announced before they start and timed when they end, in that order, before the ready line."""
    out = _serve_until_ready([], {"TINYVLLM_CACHE": str(tmp_path / "cache")}, tmp_path / "serve.log", timeout=1200)
    steps = [r"converting GGUF \S+\.gguf \(first run", r"converted GGUF \S+ in \d+\.\ds",
             r"building CPU kernels \((native|avx2), first run, ~60-180 s\)", r"built CPU kernels in \d+\.\ds",
             r"preparing the bfloat16 weights", r"prepared the weights in \d+\.\ds", SERVE_LINE.pattern]
    at = 0
    for step in steps:
        m = re.compile(step).search(out, at)
        assert m is not None, f"{step!r} missing after offset {at}:\n{out[-4000:]}"
        at = m.end()


def test_kernel_build_is_announced_before_it_starts_and_timed(tmp_path, monkeypatch, caplog):
    """The build announcement comes before the compiler runs and the timed line after it (the compiler is replaced
    by a recorder here; the real build's lines are checked by the slow test above)."""
    import logging

    import torch.utils.cpp_extension

    from tinyvllm.kernels import cpu as cpu_mod

    monkeypatch.setenv("TINYVLLM_CACHE", str(tmp_path))
    monkeypatch.setattr(cpu_mod, "_KERNEL", None)
    monkeypatch.setattr(cpu_mod, "_KERNEL_TRIED", False)
    seen: list[str] = []

    def load(**kw):
        seen.extend(r.getMessage() for r in caplog.records)  # what was logged when the compiler started
        return object()

    monkeypatch.setattr(torch.utils.cpp_extension, "load", load)
    with caplog.at_level(logging.INFO, logger="tinyvllm"):
        assert cpu_mod.cpu_kernels() is not None
    assert any(m.startswith("building CPU kernels (") and "first run, ~60-180 s) in " in m and str(tmp_path) in m
               for m in seen)
    assert not any(m.startswith("built CPU kernels") for m in seen)
    assert re.search(r"built CPU kernels in \d+\.\ds", caplog.text), caplog.text
