"""Executors: how the engine core reaches its worker(s) (see :mod:`tinyvllm.executor.abstract`)."""

from __future__ import annotations

from tinyvllm.config import EngineConfig
from tinyvllm.executor.abstract import Executor


def get_executor_class(config: EngineConfig) -> type[Executor]:
    """The executor class for ``config``: uniprocess until tensor parallelism adds a multiprocess one."""
    from tinyvllm.executor.uniproc import UniProcExecutor

    return UniProcExecutor
