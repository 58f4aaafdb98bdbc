"""tinyvllm: a small, fast LLM inference engine and OpenAI-compatible server."""

import os as _os

# How idle OpenMP threads wait, chosen before torch loads libgomp (i.e. before any torch import).
# A decode step is ~200 short parallel regions. Threads that sleep at once (OMP_WAIT_POLICY=PASSIVE)
# pay a futex wake-up per region; threads that spin long collapse when another process wants a core:
# a waiting thread burns the slice its partner needs. Batch-1 decode step with one `yes` busy loop on
# the 2-core machine (docs/benchmarks.md, 2026-12-01): 266-331 ms at GOMP_SPINCOUNT=100000 (spin ~5 ms),
# 104-132 ms at 10000, 65 ms at 3000, 47 ms at 1000; quiet, all of them 19-27 ms (noise). 1000 spins
# (~50 us) cover the gap between two regions of a step and give the core back soon after.
# Either variable set by the user wins.
if "OMP_WAIT_POLICY" not in _os.environ and "GOMP_SPINCOUNT" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "1000"

# torch's THP_MEM_ALLOC_ENABLE (huge pages for every CPU allocation of >= 2 MiB) is left as the user
# sets it, off by default. It was set to 1 here for a batch-1 decode step that read ~0.9x in A/B pairs
# (2026-12-02, inside the noise); at batch 64 it costs ~13 ms a step in fresh allocations (logits,
# sampling: each 2 MiB-aligned, madvised and faulted in again every step), -8 to -12 % of offline
# throughput, and the batch-1 step gained nothing in a new A/B (docs/benchmarks.md, 2026-12-03).

from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
