"""The executor interface between the engine core and its workers (as vLLM v1's ``Executor``).

``EngineCore → Executor → Worker → ModelRunner``. The core speaks only data to
the executor: a :class:`~tinyvllm.scheduler_output.SchedulerOutput` in, a
:class:`~tinyvllm.outputs.ModelRunnerOutput` out. Implementations:

* :class:`~tinyvllm.executor.uniproc.UniProcExecutor`: one worker in the core's process;
* :class:`~tinyvllm.executor.multiproc.MultiprocExecutor`: one worker process per tensor-parallel rank in a
  ``torch.distributed`` group, the schedule sent to every rank, rank 0's output returned.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any

import torch

from tinyvllm.config import EngineConfig
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.worker.worker import ModelInfo


class Executor(ABC):
    """Holds the workers; loads the model on construction.

    Args:
        config: the engine configuration (its device already resolved).
        device: the resolved device.
        model_dir: the resolved HF-style model directory.
        model: an already-loaded model (uniprocess only; tests share weights between engines).
    """

    def __init__(self, config: EngineConfig, device: torch.device, model_dir: str | Path,
                 model: Any = None) -> None:
        self.config = config
        self.device = device

    @abstractmethod
    def model_info(self) -> ModelInfo:
        """Facts about the loaded model (vocabulary, positions, KV bytes per token)."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate ``num_blocks`` KV blocks on every worker."""

    def initialize_kv_offload(self, num_slots: int, path: str | None = None) -> list[tuple[int, int]]:
        """Create the KV offload tier on every worker; return the ``(slot, block hash)`` pairs a disk
        tier kept from a previous run (see :meth:`tinyvllm.worker.worker.Worker.initialize_kv_offload`)."""
        raise NotImplementedError(f"{type(self).__name__} has no KV offload tier")

    def initialize_kv_connector(self, engine_id: str) -> dict:
        """Start the worker half of the KV connector on every worker; return what the scheduler half needs
        (see :meth:`tinyvllm.worker.worker.Worker.initialize_kv_connector`)."""
        raise NotImplementedError(f"{type(self).__name__} has no KV connector")

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on the workers and return the sampled tokens."""

    def check_health(self) -> None:
        """Raise if a worker is gone (the engine core calls this about once a second; in-process: no-op)."""

    def shutdown(self) -> None:
        """Release the workers (no-op in-process)."""
