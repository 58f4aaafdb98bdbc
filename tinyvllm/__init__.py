"""tinyvllm: a small, fast LLM inference engine and OpenAI-compatible server."""

import os as _os

# OpenMP threads that spin while waiting collapse throughput by ~10x as soon as another
# process (the API server, a test client) wants a core of this 2-core machine: measured
# 25 ms vs 182 ms per batch-1 decode step. Passive waiting must be chosen before torch
# loads libgomp, i.e. before any torch import.
_os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
