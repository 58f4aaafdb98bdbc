"""Shared fixtures: the real SmolLM2 model is loaded once per test session."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# httpx's one-shot functions (httpx.get / post / stream / request ...) build a client per call, and a client
# loads the CA bundle into a new SSL context: 40-90 ms per call on 2 vCPUs, several times the request itself.
# Every URL the tests call is plain http:// on 127.0.0.1, where verify has no effect, so the one-shot calls
# here skip it (a client with verify=False: ~2 ms). Clients the tests make themselves are unchanged.
for _name in ("request", "stream", "get", "options", "head", "post", "put", "patch", "delete"):
    setattr(httpx, _name, functools.partial(getattr(httpx, _name), verify=False))


@pytest.fixture(scope="session", autouse=True)
def _drop_cache_entries_of_test_ggufs(tmp_path_factory):
    """After the session: remove from ``$TINYVLLM_CACHE`` what the GGUFs the tests wrote (under this session's
    basetemp) left there: their conversions (``loader.convert_gguf_cached``), the weights prepared from those,
    and their native repacks (``gguf_quant.native_cache_path``). Each is keyed by its file's path, so without
    this every run left ~10 new entries (29 MB each for a random GGUF with SmolLM2's vocabulary) in the
    user's cache for good. Only entries derived from files under the basetemp are touched."""
    yield
    import shutil

    from tinyvllm import envs
    from tinyvllm.model.gguf_quant import native_cache_path
    from tinyvllm.model.loader import _gguf_key

    root, base = envs.TINYVLLM_CACHE, tmp_path_factory.getbasetemp()
    for gguf in base.rglob("*.gguf"):
        try:
            converted = root / _gguf_key(gguf)
            native, _ = native_cache_path(gguf)
        except OSError:
            continue
        if converted.is_dir():
            for prepared in (root / "weights").glob(converted.name + "-*.safetensors"):
                prepared.unlink(missing_ok=True)
            shutil.rmtree(converted, ignore_errors=True)
        native.unlink(missing_ok=True)


@pytest.fixture(scope="session")
def smol_llm():
    """The embedded SmolLM2-135M-Instruct in bfloat16 (the default dtype)."""
    from tinyvllm import LLM

    return LLM("SmolLM2-135M-Instruct", dtype="bfloat16")


@pytest.fixture(scope="session")
def smol_llm_fp32():
    """The embedded SmolLM2-135M-Instruct in float32 (dequantized at load: ``quantization='auto'`` keeps the
    exact dequantized path for float32), loaded once for the modules that compare against transformers."""
    from tinyvllm import LLM

    return LLM("SmolLM2-135M-Instruct", dtype="float32")


@pytest.fixture(scope="session")
def hf_smol_fp32():
    """transformers' LlamaForCausalLM loading the same GGUF (its own dequantizer), float32, in eval mode: the
    reference of tests/test_real_model.py and tests/test_prompt_logprobs.py, loaded once."""
    import torch
    from transformers import AutoModelForCausalLM

    from tinyvllm.model.loader import _find_alias_gguf, transformers_reads_gguf_with_cached_reader

    gguf = _find_alias_gguf("SmolLM2-135M-Instruct")
    # transformers' own parse and dequantizer; the file's parse is the cached ndarray reader's (the same fields
    # and tensors as gguf's reader, compared in test_quant_gguf), ~7 s less than gguf's two parses.
    with transformers_reads_gguf_with_cached_reader():
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def shared_server(tmp_path_factory):
    """One real ``tinyvllm serve`` (SmolLM2, bf16; flags: ``server_utils.SHARED_SERVER_ARGS``) for every
    module that can share it, started on first use and stopped at the end of the session.
    ``TINYVLLM_TEST_SERVER_ARGS`` appends flags, to run the server tests on another configuration, e.g.
    ``TINYVLLM_TEST_SERVER_ARGS="--tensor-parallel-size 2" pytest tests/test_server.py`` (docs/parallelism.md)."""
    import shlex

    from server_utils import SHARED_SERVER_ARGS, running_server

    extra = shlex.split(os.environ.get("TINYVLLM_TEST_SERVER_ARGS", ""))
    yield from running_server(tmp_path_factory.mktemp("shared_server") / "server.log", SHARED_SERVER_ARGS + extra)


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory):
    """The session's second shared ``tinyvllm serve`` (flags: ``server_utils.keyed_server_args``): two API keys
    (``KEYED_SERVER_KEYS``; ``srv.headers`` carries the first) and a Responses store at ``srv.store_path``."""
    from server_utils import KEYED_SERVER_KEYS, keyed_server_args, running_server

    tmp = tmp_path_factory.mktemp("keyed_server")
    for srv in running_server(tmp / "server.log", keyed_server_args(tmp / "responses.sqlite")):
        srv.headers = {"Authorization": f"Bearer {KEYED_SERVER_KEYS[0]}"}
        srv.store_path = tmp / "responses.sqlite"
        yield srv


@pytest.fixture(scope="session")
def make_smol_llm(smol_llm):
    """Factory for bf16 engines with other options, sharing the loaded weights."""
    from tinyvllm import LLM

    def make(**kwargs):
        return LLM("SmolLM2-135M-Instruct", dtype="bfloat16",
                   _preloaded_model=smol_llm.llm_engine.core.model, **kwargs)

    return make


CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
    "Explain what a CPU does in one sentence.",
    "Translate 'good morning' into Spanish.",
    "How many legs does a spider have?",
]


_BACKGROUND: list = []  # the processes started by pytest_collection_modifyitems, killed at the end if still running


def pytest_collection_modifyitems(config, items):
    """Start the background work of the selected tests that have some (a module-level
    ``_start_<test name>_in_background(tmp)`` function returning the processes it started: test_triton_kernels'
    sm_90 compiles, test_cli_commands' ``generate`` and ``chat``), and lower them to nice 19 at once, so they use
    the CPU the other tests leave idle (the suite keeps ~0.6 of 2 cores idle on average, waiting on servers);
    each test collects its own wherever the random order puts it."""
    import tempfile

    if config.option.collectonly:
        return
    for item in items:
        start = getattr(getattr(item, "module", None), f"_start_{getattr(item, 'originalname', '')}_in_background",
                        None)
        if start is not None:
            for proc in start(Path(tempfile.mkdtemp(prefix="background-", dir=config._tmp_path_factory.getbasetemp()))):
                os.setpriority(os.PRIO_PROCESS, proc.pid, 19)  # before it starts threads or children: they inherit it
                _BACKGROUND.append(proc)


def pytest_sessionfinish(session, exitstatus):
    """A background process whose test did not run (``-x``, an interrupt) is not left behind."""
    for proc in _BACKGROUND:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the random order's seed at the end, also under ``-q`` (which hides pytest-randomly's header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"random test order: replay it with -p randomly --randomly-seed={seed}")


def assert_no_kv_leak(llm) -> None:
    """After its requests finished: the engine owns no KV block, runs and queues no request, and the KV
    manager's invariants hold (free queue, ref counts, prefix-cache map)."""
    s = llm.stats()
    assert s["kv_blocks_used"] == 0 and s["num_running"] == 0 and s["num_waiting"] == 0, s
    llm.llm_engine.core.scheduler.kv.check_invariants()
