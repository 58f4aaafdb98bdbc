"""The uniprocess executor: one worker, in the engine core's own process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinyvllm.config import EngineConfig
from tinyvllm.executor.abstract import Executor
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.worker.worker import ModelInfo, Worker


class UniProcExecutor(Executor):
    """Calls one in-process :class:`~tinyvllm.worker.worker.Worker` directly."""

    def __init__(self, config: EngineConfig, device: torch.device, model_dir: str | Path,
                 model: Any = None) -> None:
        super().__init__(config, device, model_dir, model)
        self.worker = Worker(config, device, model_dir, model)

    def model_info(self) -> ModelInfo:
        return self.worker.model_info()

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self.worker.initialize_kv_cache(num_blocks, max_model_len)

    def initialize_kv_offload(self, num_slots: int, path: str | None = None) -> list[tuple[int, int]]:
        return self.worker.initialize_kv_offload(num_slots, path)

    def initialize_kv_connector(self, engine_id: str) -> dict:
        return self.worker.initialize_kv_connector(engine_id)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if self.worker.kv_connector is not None:
            self.worker.kv_connector.shutdown()
