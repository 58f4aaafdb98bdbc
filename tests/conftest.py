"""Shared fixtures: the real SmolLM2 model is loaded once per test session."""

from __future__ import annotations

import os

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def smol_llm():
    """The embedded SmolLM2-135M-Instruct in bfloat16 (the default dtype)."""
    from tinyvllm import LLM

    return LLM("SmolLM2-135M-Instruct", dtype="bfloat16")


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


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """Print the random order's seed at the end, also under ``-q`` (which hides pytest-randomly's header)."""
    seed = getattr(config.option, "randomly_seed", None)
    if isinstance(seed, int) and config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"random test order: replay it with -p randomly --randomly-seed={seed}")
