"""Every environment variable tinyvllm reads, in one place (as vLLM's ``envs.py``).

Each is read when asked for (``envs.TINYVLLM_CACHE``), not at import, so a test's
``monkeypatch.setenv`` takes effect. Nothing here imports torch.

| variable | default | what it does |
|---|---|---|
| ``TINYVLLM_CACHE`` | ``~/.cache/tinyvllm`` | converted GGUF models and the C++ kernel builds |
| ``TINYVLLM_ATTENTION`` | ``auto`` | force an attention backend: ``cpu`` (C++ kernels), ``torch`` (PyTorch float64 reference, no C++ at all) or ``triton`` (Triton kernels; on the CPU only with ``TRITON_INTERPRET=1``, for tests); ``cpp`` is an old name of ``cpu`` |
| ``TINYVLLM_NUM_THREADS`` | ``0`` (torch's default) | torch thread count of the engine core |
| ``TINYVLLM_ENGINE_START_TIMEOUT`` | ``600`` | seconds the API process waits for the engine core to load |
| ``TINYVLLM_API_KEY`` | unset | (read by the server, see its ``--api-key``) |
| ``TINYVLLM_GRAMMAR_COMPILE_NICE`` | ``19`` | nice value of the grammar-compile thread (Linux; ``0`` = the engine's own priority): a compile then runs in the engine's idle time instead of taking a core from its parallel regions |
| ``TINYVLLM_GRAMMAR_COMPILE_SCHED`` | ``normal`` | scheduling class of the grammar-compile thread (Linux): ``normal`` (the nice value alone) or ``idle`` (``SCHED_IDLE``: any engine thread that wakes takes its core back at once; measured no better than nice 19, docs/benchmarks.md) |
| ``TINYVLLM_GGUF_ACTIVATIONS`` | ``auto`` | activations of the native GGUF linears (``--quantization gguf``): ``int8`` (quantized per row and 32-block, ``gemm_gguf_q8``: Q8_0 / Q4_0 / Q4_1 / Q4_K), ``bf16`` (``gemm_gguf``: the model dtype's activations unquantized, float32 ones too), or ``auto``: ``int8`` for a bfloat16 model where its AVX512-BF16 + VNNI kernel is built (AMD Zen 4, Intel Sapphire Rapids), else ``bf16`` (a float32 model's activations stay float32: the dequantized float32 model's results) (on AVX2 alone, where ``--quantization auto`` runs native by default, ``int8`` runs the AVX2 kernel: the fast path, 1.4-1.8x faster per decode step at ~4x the KL against float32); Q6_K always ``bf16`` |
| ``TINYVLLM_CPU_POOL`` | ``auto`` | where the C++ kernels' parallel loops run: ``auto`` on ``cpu_pool.h``'s pool (dynamic chunks; the caller never waits for a thread that has not started, and runs alone for a while after one lost its core) in steps of exactly one token (batch-1 decode), on ``at::parallel_for`` otherwise; ``1`` on the pool in every step; ``0`` never on the pool (docs/benchmarks.md, "A parallel pool for shared cores" and "The pool in batch-1 steps only") |
| ``TINYVLLM_KV_ABORT_REQUEST_TIMEOUT`` | ``480`` | seconds a prefill engine (``--kv-transfer-config``) keeps the KV blocks of a finished ``do_remote_decode`` request that no decode engine pulls; then they are freed (vLLM's ``VLLM_NIXL_ABORT_REQUEST_TIMEOUT``, also read when this is unset) |
| ``TINYVLLM_DIST_TIMEOUT`` | ``1800`` | seconds a tensor-parallel rank waits in one ``torch.distributed`` call (joining the group, a collective) before it fails; a peer that dies fails the call at once (docs/parallelism.md) |
| ``TINYVLLM_MAX_N_SEQUENCES`` | ``128`` | the largest ``n`` (samples per prompt, and per request) the server accepts (vLLM's ``VLLM_MAX_N_SEQUENCES``, 16384 there; lower here since a CPU engine creates every sample's state up front) |
| ``TINYVLLM_DP_PREFILL_WEIGHT`` | ``16`` | ``--data-parallel-size`` > 1 with ``--dp-routing prefix``: what one prefill block to compute weighs against one block held by a running request in the router's cost (NVIDIA Dynamo's ``kv_overlap_score_weight``, 1 there; higher keeps a conversation on the replica holding its history longer, lower balances the load sooner; docs/parallelism.md) |
| ``TINYVLLM_KERNEL_ISA`` | ``native`` | which instruction set the C++ CPU kernels are compiled for: ``native`` (``-march=native``: AVX-512 / AMX where the CPU has them) or ``avx2`` (``-march=haswell``: AVX2 + FMA + F16C, no AVX-512, built as a separately named extension) to run the AVX2 paths on an AVX-512 machine (tests, ``scripts/kernel_bits.py``) |

Read by the C++ kernels themselves (not through this module): ``TINYVLLM_AMX_GEMM`` (``0`` starts
``gemm_bf16`` on its ``vdpbf16ps`` path instead of AMX tiles; for A/B runs), ``TINYVLLM_AMX_ATTENTION``
(``0`` starts the tiled attention on its AVX-512 vector path instead of AMX tiles: with
``TINYVLLM_AMX_GEMM=0``, a server runs as on a CPU without AMX, for A/B runs), and
``TINYVLLM_CPU_POOL`` once more (``1`` turns the pool on when the kernels load; ``auto`` is applied
per step by the model runner).

Variables of other programs that tinyvllm sets or reads: ``GOMP_SPINCOUNT`` /
``OMP_WAIT_POLICY`` (set on import of :mod:`tinyvllm` unless already set), ``THP_MEM_ALLOC_ENABLE``
(torch's: huge pages for allocations of >= 2 MiB; not set by tinyvllm: it slows batched steps),
``TRITON_INTERPRET`` (read by triton), ``TOKENIZERS_PARALLELISM``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

_VARS: dict[str, Callable[[], Any]] = {
    "TINYVLLM_CACHE": lambda: (Path(os.environ["TINYVLLM_CACHE"]).expanduser() if os.environ.get("TINYVLLM_CACHE")
                               else Path.home() / ".cache" / "tinyvllm"),
    "TINYVLLM_ATTENTION": lambda: (os.environ.get("TINYVLLM_ATTENTION") or "auto").lower(),
    "TINYVLLM_NUM_THREADS": lambda: int(os.environ.get("TINYVLLM_NUM_THREADS") or 0),
    "TINYVLLM_ENGINE_START_TIMEOUT": lambda: float(os.environ.get("TINYVLLM_ENGINE_START_TIMEOUT") or 600),
    "TINYVLLM_API_KEY": lambda: os.environ.get("TINYVLLM_API_KEY") or None,
    "TINYVLLM_GRAMMAR_COMPILE_NICE": lambda: int(os.environ.get("TINYVLLM_GRAMMAR_COMPILE_NICE") or 19),
    "TINYVLLM_GRAMMAR_COMPILE_SCHED": lambda: (os.environ.get("TINYVLLM_GRAMMAR_COMPILE_SCHED") or "normal").lower(),
    "TINYVLLM_GGUF_ACTIVATIONS": lambda: (os.environ.get("TINYVLLM_GGUF_ACTIVATIONS") or "auto").lower(),
    "TINYVLLM_CPU_POOL": lambda: (os.environ.get("TINYVLLM_CPU_POOL") or "auto").lower(),
    "TINYVLLM_KV_ABORT_REQUEST_TIMEOUT": lambda: float(os.environ.get("TINYVLLM_KV_ABORT_REQUEST_TIMEOUT")
                                                       or os.environ.get("VLLM_NIXL_ABORT_REQUEST_TIMEOUT") or 480),
    "TINYVLLM_DIST_TIMEOUT": lambda: float(os.environ.get("TINYVLLM_DIST_TIMEOUT") or 1800),
    "TINYVLLM_MAX_N_SEQUENCES": lambda: int(os.environ.get("TINYVLLM_MAX_N_SEQUENCES") or 128),
    "TINYVLLM_DP_PREFILL_WEIGHT": lambda: float(os.environ.get("TINYVLLM_DP_PREFILL_WEIGHT") or 16),
    "TINYVLLM_KERNEL_ISA": lambda: (os.environ.get("TINYVLLM_KERNEL_ISA") or "native").lower(),
}


def __getattr__(name: str) -> Any:
    if name in _VARS:
        return _VARS[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_VARS)
