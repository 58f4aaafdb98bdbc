"""Worker: one device's share of the engine. Loads the model, owns the model runner and its KV cache.

The engine core never touches a worker directly; it goes through an
:class:`~tinyvllm.executor.abstract.Executor`, which holds one worker in-process
(uniprocess) or one per tensor-parallel rank in its own process (multiprocess,
next round). A worker's inputs and outputs are data (a
:class:`~tinyvllm.scheduler_output.SchedulerOutput` in, a
:class:`~tinyvllm.outputs.ModelRunnerOutput` out), so either placement works.

KV-connector hook (next round, P/D disaggregation and KV offload): the worker
half of a connector loads external KV into this worker's blocks before
:meth:`execute_model` runs the forward, and saves finished blocks after it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tinyvllm import envs
from tinyvllm.config import EngineConfig
from tinyvllm.model.weights import load_model
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.worker.model_runner import ModelRunner

logger = logging.getLogger("tinyvllm")


@dataclass(frozen=True)
class ModelInfo:
    """What the engine core needs to know of the loaded model to size the KV cache and check requests.

    Attributes:
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        max_position_embeddings: longest sequence the model's positions allow (tokens).
        kv_bytes_per_token: bytes of K and V for one token across all layers, in the KV dtype.
        eos_token_id: the model config's EOS id(s), if any.
    """

    vocab_size: int
    max_position_embeddings: int
    kv_bytes_per_token: int
    eos_token_id: int | list[int] | None


class Worker:
    """Loads the model on ``device`` and, once the KV cache is sized, runs steps on it.

    Args:
        config: the engine configuration.
        device: the resolved device (``cpu`` or ``cuda:N``).
        model_dir: the resolved HF-style model directory.
        model: an already-loaded model to use instead of loading one (tests share weights).

    Raises:
        ValueError: the preloaded model is on another device type; unsupported config or weights.
    """

    def __init__(self, config: EngineConfig, device: torch.device, model_dir: str | Path,
                 model: torch.nn.Module | None = None) -> None:
        self.config = config
        self.device = device
        mc = config.model_config
        self.dtype = mc.torch_dtype
        if envs.TINYVLLM_NUM_THREADS > 0:
            torch.set_num_threads(envs.TINYVLLM_NUM_THREADS)
        if model is None:
            model = load_model(model_dir, self.dtype, device, load_format=mc.load_format, seed=mc.seed)
        model_device = next(model.parameters()).device
        if model_device.type != device.type:
            raise ValueError(f"the preloaded model is on {model_device}, but the engine runs on {device}")
        self.model = model
        self.model_runner: ModelRunner | None = None

    def model_info(self) -> ModelInfo:
        cfg = self.model.config
        return ModelInfo(cfg.vocab_size, cfg.max_position_embeddings, cfg.kv_bytes_per_token(self.dtype),
                         getattr(cfg, "eos_token_id", None))

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer and build the model runner (CUDA graphs captured here)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        self.model_runner = ModelRunner(self.model, num_blocks, cc.block_size, self.dtype, self.device,
                                        max_num_seqs=sc.max_num_seqs, max_model_len=max_model_len,
                                        enforce_eager=self.config.model_config.enforce_eager)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step.

        Raises:
            RuntimeError: before :meth:`initialize_kv_cache`.
        """
        if self.model_runner is None:
            raise RuntimeError("initialize_kv_cache must run before execute_model")
        return self.model_runner.execute(scheduler_output)
