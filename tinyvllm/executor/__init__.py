"""Executors: how the engine core reaches its worker(s) (see :mod:`tinyvllm.executor.abstract`)."""

from __future__ import annotations

from tinyvllm.config import EngineConfig
from tinyvllm.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for ``config``: the in-process one, or one worker process per tensor-parallel rank
    (``tensor_parallel_size`` > 1, :mod:`tinyvllm.executor.multiproc`)."""
    if config.parallel_config.tensor_parallel_size > 1:
        from tinyvllm.executor.multiproc import MultiprocExecutor

        return MultiprocExecutor
    from tinyvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor
