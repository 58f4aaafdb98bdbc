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

# Transparent huge pages for torch's large CPU allocations (packed weights, KV cache, activations):
# c10's allocator aligns every allocation of >= 2 MiB to 2 MiB and madvise(MADV_HUGEPAGE)s it, which
# matters where the kernel's THP mode is `madvise` (Debian's default) and would otherwise back the
# ~160 MB of packed linears that every decode step streams with 4 KiB pages. Batch-1 decode step on
# the 2-core Zen 4 machine, A/B pairs (docs/benchmarks.md, 2026-12-02): 0.69-1.0x quiet, 0.92-1.05x
# beside a busy loop, a median ~0.9x inside that machine's noise. Read by c10 once, at its first allocation,
# so it is set here, before torch loads. A value set by the user wins (0 turns it off).
_os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

__version__ = "0.1.0"


def __getattr__(name: str):  # lazy: importing the package must not load torch models
    if name == "LLM":
        from tinyvllm.entrypoints.llm import LLM

        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]
