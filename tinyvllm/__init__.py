"""tinyvllm: a small, fast LLM inference engine and OpenAI-compatible server."""

import os as _os

# How idle OpenMP threads wait, chosen before torch loads libgomp (i.e. before any torch import).
# A decode step is ~200 short parallel regions. Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE)
# pay a futex wake-up per region: 13.1 ms per batch-1 step. Threads that spin forever (ACTIVE)
# collapse throughput ~10x when another process (the API server, a client) wants a core of a
# 2-core machine. A bounded spin before sleeping gets both: 7.9 ms per batch-1 step, and over HTTP
# TPOT 9.0 ms (vs 13.4) and 528 vs 418 output tok/s at concurrency 16 (docs/benchmarks.md).
# Either variable set by the user wins.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "100000"

from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
