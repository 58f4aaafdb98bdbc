"""Worker: one device's share of the engine. Loads the model, owns the model runner and its KV cache.

The engine core never touches a worker directly; it goes through an
:class:`~tinyvllm.executor.abstract.Executor`, which holds one worker in-process
(uniprocess) or one per tensor-parallel rank in its own process (multiprocess,
next round). A worker's inputs and outputs are data (a
:class:`~tinyvllm.scheduler_output.SchedulerOutput` in, a
:class:`~tinyvllm.outputs.ModelRunnerOutput` out), so either placement works.

KV-connector hook (P/D disaggregation, :mod:`tinyvllm.distributed.kv_transfer`): the worker
half of a connector starts its loads before :meth:`execute_model` runs the forward, waits for
its saves after it, and reports the transfers that completed with the step's output.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tinyvllm import envs
from tinyvllm.attention.kv_quant import QUANTIZED, canonical_kv_cache_dtype, kv_bytes_per_token
from tinyvllm.config import EngineConfig
from tinyvllm.model.weights import load_model
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from tinyvllm.distributed.parallel_state import TPGroup

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
                 model: torch.nn.Module | None = None, tp: "TPGroup | None" = None) -> None:
        self.config = config
        self.device = device
        mc = config.model_config
        self.dtype = mc.torch_dtype
        if envs.TINYVLLM_NUM_THREADS > 0:
            torch.set_num_threads(envs.TINYVLLM_NUM_THREADS)
        if model is None:
            model = load_model(model_dir, self.dtype, device, load_format=mc.load_format, seed=mc.seed,
                               quantization=mc.quantization)
        self.tp = tp
        if tp is not None:  # this rank's share of the weights and KV heads (tensor parallelism)
            from tinyvllm.model.tensor_parallel import shard_model

            shard_model(model, tp)
        model_device = next(model.parameters()).device
        if model_device.type != device.type:
            raise ValueError(f"the preloaded model is on {model_device}, but the engine runs on {device}")
        self.model = model
        self.model_runner: ModelRunner | None = None
        self.model_dir = Path(model_dir)
        self.kv_connector = None  # the worker half of a KV connector (--kv-transfer-config), else None

    def quantization(self) -> str:
        """``gguf`` when the linears run on native GGUF blocks, else ``none``."""
        return str(getattr(self.model, "quantization", "none"))

    def kv_cache_shape(self) -> tuple[int, ...]:
        """Shape of one layer's KV cache tensor on this worker ([2, blocks, block_size, its KV heads, D])."""
        return tuple(self.model_runner.kv_caches[0].shape)

    def tp_comm_stats(self) -> tuple[float, int]:
        """``(seconds, calls)`` this rank spent in tensor-parallel collectives since the last call (then reset)."""
        return self.tp.reset_comm_stats() if self.tp is not None else (0.0, 0)

    def model_info(self) -> ModelInfo:
        cfg = self.model.config
        kind = canonical_kv_cache_dtype(self.config.cache_config.kv_cache_dtype)
        per_token = kv_bytes_per_token(kind, self.dtype, cfg.num_hidden_layers, cfg.num_key_value_heads,
                                       cfg.head_dim)
        return ModelInfo(cfg.vocab_size, cfg.max_position_embeddings, per_token, getattr(cfg, "eos_token_id", None))

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        """Allocate ``num_blocks`` KV blocks per layer and build the model runner (CUDA graphs captured here)."""
        cc, sc = self.config.cache_config, self.config.scheduler_config
        self.model_runner = ModelRunner(self.model, num_blocks, cc.block_size, self.dtype, self.device,
                                        max_num_seqs=sc.max_num_seqs, max_model_len=max_model_len,
                                        enforce_eager=self.config.model_config.enforce_eager,
                                        kv_cache_dtype=cc.kv_cache_dtype)

    def initialize_kv_offload(self, num_slots: int, path: str | None = None) -> list[tuple[int, int]]:
        """Create the KV offload tier (``num_slots`` blocks; in host RAM, or in a file under ``path``) and
        return the ``(slot, block hash)`` pairs a disk tier found from a previous run (oldest first).

        Raises:
            RuntimeError: before :meth:`initialize_kv_cache`.
            KVTierError: ``path`` unwritable, or too little disk space.
        """
        from tinyvllm.worker.kv_offload import DiskKVTier, HostKVTier, make_fingerprint

        runner = self.model_runner
        if runner is None:
            raise RuntimeError("initialize_kv_cache must run before initialize_kv_offload")
        cfg = self.model.config
        kv0 = runner.kv_caches[0]
        slot_shape = (len(runner.kv_caches), 2, *kv0.shape[2:])
        if path is None:
            tier = HostKVTier(num_slots, slot_shape, kv0.dtype, pin_memory=self.device.type == "cuda")
        else:
            mc = self.config.model_config
            extra = {"load_format": mc.load_format, "seed": mc.seed} if mc.load_format == "dummy" else {}
            if getattr(self.model, "quantization", "none") != "none":  # native GGUF: other KV values
                extra["quantization"] = self.model.quantization
            if runner.kv_cache_dtype in QUANTIZED:  # int8/fp8 blocks (scales inside): other bytes per block
                extra["kv_cache_dtype"] = runner.kv_cache_dtype
            fp = make_fingerprint(self.model_dir, kv0.dtype, runner.block_size, cfg.num_hidden_layers,
                                  int(kv0.shape[3]), int(kv0.shape[4]), extra)
            tier = DiskKVTier(path, num_slots, slot_shape, kv0.dtype, fp)
        runner.kv_offload = tier
        return tier.entries()

    def initialize_kv_connector(self, engine_id: str) -> dict:
        """Start the worker half of the configured KV connector over this worker's KV cache tensors; return
        what its scheduler half needs (``side_channel_host`` / ``side_channel_port``).

        Raises:
            RuntimeError: before :meth:`initialize_kv_cache`.
            ValueError: bad connector options; its side channel cannot be bound.
        """
        from tinyvllm.distributed.kv_transfer import KVConnectorRole, create_kv_connector

        runner = self.model_runner
        if runner is None:
            raise RuntimeError("initialize_kv_cache must run before initialize_kv_connector")
        mc = self.config.model_config
        # Engines whose blocks are interchangeable share this: the model, its dtype and weights format, and
        # every KV tensor's layout apart from the number of blocks.
        layout = ";".join(f"{t.dtype}{list(t.shape[:1]) + list(t.shape[2:])}" for t in runner.kv_caches)
        fingerprint = (f"{self.model_dir.name}|{self.dtype}|{getattr(self.model, 'quantization', 'none')}|"
                       f"{mc.load_format}{'/' + str(mc.seed) if mc.load_format == 'dummy' else ''}|{layout}")
        conn = create_kv_connector(self.config.cache_config.kv_transfer_config, KVConnectorRole.WORKER,
                                   {"block_size": runner.block_size, "engine_id": engine_id,
                                    "fingerprint": fingerprint})
        conn.register_kv_caches(runner.kv_caches)
        self.kv_connector = conn
        return conn.handshake_info()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step (with a KV connector: its loads are started before the forward, and the transfers
        that completed are reported in ``kv_connector_output``).

        Raises:
            RuntimeError: before :meth:`initialize_kv_cache`.
        """
        if self.model_runner is None:
            raise RuntimeError("initialize_kv_cache must run before execute_model")
        conn = self.kv_connector
        if conn is None:
            return self.model_runner.execute(scheduler_output)
        conn.bind_connector_metadata(scheduler_output.kv_connector_metadata)
        conn.start_load_kv()
        out = self.model_runner.execute(scheduler_output)
        conn.wait_for_save()
        if scheduler_output.is_empty:  # nothing computed: wait a moment for a transfer rather than spin
            conn.wait_for_transfers(0.002)
        out.kv_connector_output = conn.get_finished(set(scheduler_output.finished_req_ids))
        conn.clear_connector_metadata()
        return out
