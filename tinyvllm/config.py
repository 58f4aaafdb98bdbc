"""Engine configuration: model, KV cache and scheduler settings (validated, frozen dataclasses), and
:class:`EngineArgs`, the one list of engine options from which the CLI flags and the configs are made.

Option names follow vLLM's engine arguments (``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``enable_prefix_caching``, ``max_model_len``...) so a
vLLM user's habits carry over. This module imports no torch at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is imported where it is needed: the API process parses flags before it loads torch
    import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATION_MODES = ("auto", "gguf", "none")
SCHEDULING_POLICIES = ("continuous", "static")
# --kv-cache-dtype (vLLM's flag and names; int8 is tinyvllm's; fp8 = fp8_e4m3): tinyvllm.attention.kv_quant
KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3")

_DTYPES = {  # name -> attribute of torch
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
}


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Map a dtype name (``auto``, ``bfloat16``, ``float32``, ...) to a torch dtype.

    ``auto`` is bfloat16 (fast on AVX-512 BF16 CPUs and on GPUs).

    Raises:
        ValueError: unknown dtype name.
    """
    name = _check_dtype_name(dtype)
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return torch.bfloat16 if name == "auto" else getattr(torch, _DTYPES[name])


def _check_dtype_name(dtype: "str | torch.dtype") -> str:
    """The lower-cased name of a dtype, checked (a ``torch.dtype`` as it is); imports torch only for a
    value that is not a string.

    Raises:
        ValueError: unknown dtype name.
    """
    if not isinstance(dtype, str):
        import torch

        if isinstance(dtype, torch.dtype):
            return str(dtype)
    name = str(dtype).lower()
    if name != "auto" and name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}")
    return name


def parse_size(value: int | float | str, name: str = "kv_cache_memory") -> int:
    """Parse a memory size: an int of bytes, or a string like ``'2GiB'``, ``'512MiB'``, ``'1.5GB'``.

    Returns:
        size in bytes.

    Raises:
        ValueError: unparseable or non-positive size.
    """
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        size = int(value)
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]?i?B?)?\s*", str(value), re.IGNORECASE)
        if not m:
            raise ValueError(f"{name}: cannot parse size {value!r} (use e.g. '2GiB', '512MiB' or bytes)")
        num = float(m.group(1))
        unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
        mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
        size = int(num * mult)
    if size <= 0:
        raise ValueError(f"{name} must be > 0 bytes, got {value!r}")
    return size


_DEVICE_RE = re.compile(r"auto|cpu|cuda(:[0-9]+)?")


def check_device_name(device: str | torch.device) -> str:
    """``device`` as a string, if it is ``auto``, ``cpu``, ``cuda`` or ``cuda:N``.

    Raises:
        ValueError: any other name.
    """
    name = str(device)
    if not _DEVICE_RE.fullmatch(name):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    return name


def resolve_device(device: str | torch.device) -> torch.device:
    """``auto`` -> ``cuda`` if ``torch.cuda.is_available()`` else ``cpu``; ``cuda`` -> ``cuda:N`` of the
    current CUDA device; other names as given.

    Raises:
        ValueError: an unknown device name, or CUDA asked for but not available.
    """
    import torch

    name = check_device_name(device)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r} requested but torch sees no CUDA device "
                             f"(torch {torch.__version__}); use --device cpu")
        dev = torch.device(name)
        if dev.index is None:  # always an indexed device: torch.cuda.set_device rejects a bare "cuda"
            # (device 0 unless CUDA is already initialised: the API process must not create a CUDA context)
            return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_initialized() else 0)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: only {torch.cuda.device_count()} CUDA device(s) visible")
        return dev
    return torch.device("cpu")


@dataclass(frozen=True)
class ModelConfig:
    """What model to run and how.

    Attributes:
        model: alias (``SmolLM2-135M-Instruct``), path to a ``.gguf`` file, or a
            Hugging Face model directory (config.json + *.safetensors + tokenizer).
        dtype: ``auto`` (bfloat16), ``bfloat16`` or ``float32``.
        max_model_len: longest sequence (prompt + output, tokens); default the
            model's ``max_position_embeddings``.
        seed: seed of the default random generator (unseeded requests).
        device: ``auto`` (the default: CUDA when ``torch.cuda.is_available()``, else CPU),
            ``cpu``, ``cuda`` or ``cuda:N``; resolved when the engine starts (:func:`resolve_device`).
        enforce_eager: never capture CUDA graphs (vLLM's flag); CUDA graphs of the
            decode step are used only on CUDA.
        load_format: ``auto`` (read the ``*.safetensors`` weights) or ``dummy``
            (vLLM's flag: seeded random weights of the shapes ``config.json`` gives;
            the directory needs no weight files; for benchmarks of a model's shape).
        quantization: ``auto`` (the default: a quantized GGUF runs natively where that is the faster
            path: bf16 on a CPU without AVX512-BF16, see
            :func:`~tinyvllm.model.gguf_quant.resolve_quantization`), ``none`` (dequantize at load,
            the bf16/fp32 path) or ``gguf`` (native GGUF blocks, required: an error if it cannot run).
            vLLM's flag name. Figures: docs/benchmarks.md, "Native GGUF".
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "auto"
    enforce_eager: bool = False
    load_format: str = "auto"
    quantization: str = "auto"

    def __post_init__(self) -> None:
        _check_dtype_name(self.dtype)
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        check_device_name(self.device)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)


KV_CONNECTORS = ("ZmqConnector",)
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")
# Keys of vLLM's KVTransferConfig accepted (so a vLLM command line carries over) but not used here.
_KV_TRANSFER_IGNORED = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port",
                        "kv_connector_module_path")


def _json_object(value: "str | dict", name: str) -> dict:
    """A config flag's value as a dict: JSON text is parsed, a dict passes through.

    Raises:
        ValueError: not valid JSON, or not a JSON object (the message names ``name``).
    """
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{name} is not valid JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{name} must be a JSON object, got {type(value).__name__}")
    return value


@dataclass(frozen=True)
class KVTransferConfig:
    """``--kv-transfer-config``: which KV connector moves blocks between engines (vLLM's JSON object).

    Attributes:
        kv_connector: the connector class: ``ZmqConnector`` (vLLM's NIXL protocol on the HTTP side,
            block bytes over TCP with ZMQ; :mod:`tinyvllm.distributed.kv_transfer.zmq_connector`).
        kv_role: ``kv_producer`` (a prefill engine: serves its blocks), ``kv_consumer`` (a decode
            engine: pulls blocks) or ``kv_both`` (either, per request; the default).
        kv_connector_extra_config: the connector's own options (see its module).
        engine_id: this engine's id in ``kv_transfer_params`` (default: a random one per start).
        kv_load_failure_policy: what a failed load does: ``recompute`` (the only policy: the decode
            engine computes the prompt itself, so a failure never changes a token).
    """

    kv_connector: str
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict = field(default_factory=dict)
    engine_id: str | None = None
    kv_load_failure_policy: str = "recompute"

    def __post_init__(self) -> None:
        if self.kv_connector not in KV_CONNECTORS:
            hint = (" (NIXL needs RDMA/GPU hardware; ZmqConnector speaks the same HTTP protocol with KV over TCP)"
                    if self.kv_connector == "NixlConnector" else "")
            raise ValueError(f"kv_transfer_config.kv_connector must be one of {', '.join(KV_CONNECTORS)}, "
                             f"got {self.kv_connector!r}{hint}")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_transfer_config.kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise ValueError("kv_transfer_config.kv_connector_extra_config must be a JSON object")
        if self.engine_id is not None and (not isinstance(self.engine_id, str) or not self.engine_id):
            raise ValueError(f"kv_transfer_config.engine_id must be a non-empty string, got {self.engine_id!r}")
        if self.kv_load_failure_policy != "recompute":
            raise ValueError(f"kv_transfer_config.kv_load_failure_policy must be 'recompute', "
                             f"got {self.kv_load_failure_policy!r}")

    @classmethod
    def parse(cls, value: "str | dict | KVTransferConfig | None") -> "KVTransferConfig | None":
        """A config from its JSON text (the flag), a dict (``LLM(kv_transfer_config={...})``) or as is.

        Raises:
            ValueError: not JSON, not an object, an unknown key, a missing ``kv_connector``, a bad value.
        """
        if value is None or isinstance(value, KVTransferConfig):
            return value
        value = _json_object(value, "kv_transfer_config")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(k for k in value if k not in names and k not in _KV_TRANSFER_IGNORED)
        if unknown:
            raise ValueError(f"kv_transfer_config: unknown key(s) {unknown}; known: {sorted(names)}")
        if "kv_connector" not in value:
            raise ValueError("kv_transfer_config needs 'kv_connector' (e.g. {\"kv_connector\": \"ZmqConnector\", "
                             "\"kv_role\": \"kv_both\"})")
        return cls(**{k: v for k, v in value.items() if k in names})


@dataclass(frozen=True)
class KVEventsConfig:
    """``--kv-events-config``: publish the prefix cache's changes as vLLM's KV events (a JSON object).

    Attributes:
        enable_kv_cache_events: publish at all.
        publisher: ``zmq`` (a ZMQ PUB socket) or ``null`` (none; vLLM's default).
        endpoint: where the PUB socket binds (e.g. ``tcp://*:5557``).
        topic: the first frame of every message.
        hwm: the socket's send high-water mark (messages).
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    topic: str = ""
    hwm: int = 100_000

    def __post_init__(self) -> None:
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError("kv_events_config.enable_kv_cache_events must be true or false")
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config.publisher must be 'zmq' or 'null', got {self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"kv_events_config.endpoint must be a ZMQ endpoint such as tcp://*:5557, "
                             f"got {self.endpoint!r}")
        if not isinstance(self.topic, str):
            raise ValueError("kv_events_config.topic must be a string")
        if isinstance(self.hwm, bool) or not isinstance(self.hwm, int) or self.hwm < 0:
            raise ValueError(f"kv_events_config.hwm must be an integer >= 0, got {self.hwm!r}")

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"

    @classmethod
    def parse(cls, value: "str | dict | KVEventsConfig | None") -> "KVEventsConfig | None":
        """From JSON text, a dict or as is. Raises ``ValueError`` (bad JSON, unknown key, bad value)."""
        if value is None or isinstance(value, KVEventsConfig):
            return value
        value = _json_object(value, "kv_events_config")
        names = {f.name for f in dataclasses.fields(cls)}
        ignored = ("buffer_steps", "max_queue_size")  # vLLM's replay buffer options (no replay socket here)
        unknown = sorted(k for k in value if k not in names and k not in ignored and k != "replay_endpoint")
        if unknown:
            raise ValueError(f"kv_events_config: unknown key(s) {unknown}; known: {sorted(names)}")
        if value.get("replay_endpoint") is not None:
            raise ValueError("kv_events_config.replay_endpoint: a replay socket is not supported (leave it null)")
        return cls(**{k: v for k, v in value.items() if k in names})


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block (PagedAttention page).
        kv_cache_memory: KV budget in bytes (or a string such as ``'1GiB'``); the
            number of blocks is ``kv_cache_memory // bytes_per_block``.
        num_kv_blocks: explicit number of blocks, overriding the memory budget
            (handy for tests that force preemption).
        enable_prefix_caching: reuse full blocks across requests by chained hash.
        kv_offload_size: bytes (or ``'8GiB'``...) of the KV offload tier that keeps blocks the pool
            evicts; 0 (the default) turns it off. Needs prefix caching.
        kv_offload_path: a directory: the tier is a file there (``kv_offload.bin``, of
            ``kv_offload_size`` bytes) instead of host RAM, and survives restarts.
        kv_transfer_config: the KV connector (:class:`KVTransferConfig`; given as its JSON text or a
            dict), or None: no blocks move between engines.
        kv_events_config: KV events publishing (:class:`KVEventsConfig`, JSON text or a dict), or None.
        kv_cache_dtype: ``auto`` (the model dtype), ``bfloat16``, ``int8`` or ``fp8`` (= ``fp8_e4m3``):
            the KV cache's element type, vLLM's flag (docs/kv-cache-dtype.md). ``int8``/``fp8`` store one
            byte per value plus a bfloat16 scale per (token, KV head): ~1.94x the tokens per GiB.
    """

    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_offload_size: int | str = 0
    kv_offload_path: str | None = None
    kv_transfer_config: "str | dict | KVTransferConfig | None" = None
    kv_events_config: "str | dict | KVEventsConfig | None" = None
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        object.__setattr__(self, "kv_transfer_config", KVTransferConfig.parse(self.kv_transfer_config))
        object.__setattr__(self, "kv_events_config", KVEventsConfig.parse(self.kv_events_config))
        if str(self.kv_cache_dtype).lower() not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        object.__setattr__(self, "kv_cache_memory", parse_size(self.kv_cache_memory))  # bytes, as an int
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        size = self.kv_offload_size
        size = 0 if size in (0, "0") else parse_size(size, "kv_offload_size")
        object.__setattr__(self, "kv_offload_size", size)
        if self.kv_offload_path is not None and size == 0:
            raise ValueError("kv_offload_path needs kv_offload_size (the size of the file tier, e.g. 8GiB)")
        if size and not self.enable_prefix_caching:
            raise ValueError("kv_offload_size needs prefix caching (the tier is keyed by the block hashes)")
        if self.kv_offload_path is not None:
            check_offload_dir(self.kv_offload_path)


OFFLOAD_FILE_NAME = "kv_offload.bin"  # the disk tier's file in kv_offload_path (tinyvllm.worker.kv_offload)


def check_offload_dir(path: str) -> None:
    """Raise ``ValueError`` (naming ``kv_offload_path``) unless ``path`` is, or can be made, a writable
    directory for the disk KV offload tier: not a regular file, not under one, its nearest existing
    ancestor writable, and its ``kv_offload.bin`` (if there) a regular file. Checked when the config is
    built, so a bad path is one line at start-up, not an error of the engine core after the model loads."""
    if not isinstance(path, str) or not path:
        raise ValueError(f"kv_offload_path must be a directory path, got {path!r}")
    p = os.path.abspath(path)
    if os.path.exists(p) and not os.path.isdir(p):
        raise ValueError(f"kv_offload_path {path!r} is a file, not a directory (the tier is the file "
                         f"{OFFLOAD_FILE_NAME} inside that directory)")
    existing = p
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        raise ValueError(f"kv_offload_path {path!r} cannot be created: {existing!r} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"kv_offload_path {path!r}: {existing!r} is not writable")
    tier = os.path.join(p, OFFLOAD_FILE_NAME)
    if os.path.lexists(tier) and not os.path.isfile(tier):
        raise ValueError(f"kv_offload_path {path!r}: {tier!r} exists and is not a regular file")


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level scheduler settings.

    Attributes:
        max_num_seqs: most requests running at once.
        scheduling_policy: ``continuous`` (rebuild the batch every step, Orca-style
            iteration-level scheduling) or ``static`` (admit a new batch only when
            the previous one has fully finished; a baseline for measuring waste).
        enable_chunked_prefill: split prompts longer than the remaining budget.
        max_num_batched_tokens: token budget per step, prefill chunks + decodes (default 512).
            On the CPU a step's cost grows with its tokens, so a smaller budget lets the first
            prompts of a burst finish prefill sooner: at concurrency 16 (256-token prompts) median TTFT 331 ms at 512 vs 703 ms at
            2048, with the same throughput (570 vs 567 output tok/s) and offline 746 vs 751 tok/s
            (docs/benchmarks.md). GEMMs are already at full speed from ~256 rows.
        max_waiting_requests: bound on the waiting queue (the server answers 503
            past it); ``None`` for unbounded.
    """

    max_num_batched_tokens: int = 512
    max_num_seqs: int = 256
    scheduling_policy: str = "continuous"
    enable_chunked_prefill: bool = True
    max_waiting_requests: int | None = None

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}"
            )


TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


DP_ROUTING_POLICIES = ("prefix", "round-robin", "least-loaded")


@dataclass(frozen=True)
class ParallelConfig:
    """How the model is split over processes (vLLM's ``ParallelConfig``; docs/parallelism.md).

    Attributes:
        tensor_parallel_size: ranks that each hold a share of every layer (``--tensor-parallel-size`` /
            ``-tp``): 1 runs in the engine core's process; N > 1 runs one worker process per rank in a
            ``torch.distributed`` group (gloo on the CPU, NCCL on CUDA), :mod:`tinyvllm.executor.multiproc`.
        nnodes / node_rank: nodes of a multi-node group and this one's index (torchrun's ``--nnodes`` /
            ``--node-rank``); node 0 serves HTTP and runs ranks ``0 .. tp/nnodes - 1``, node ``k`` runs only
            ranks ``k * tp/nnodes ..``.
        master_addr / master_port: where rank 0 hosts the group's TCP store (torchrun's flags; default
            ``127.0.0.1`` and, on one node, a free port, else 29500).
        torchrun_rank: set from torchrun's ``RANK`` / ``WORLD_SIZE`` environment (one process per rank,
            started by torchrun): this process's rank, else ``None``.
        data_parallel_size: full replicas of the engine behind one API server (``--data-parallel-size`` /
            ``-dp``, vLLM's flag; ``tinyvllm serve`` only): N engine-core processes, each with its own KV cache
            and prefix cache (:mod:`tinyvllm.engine.data_parallel`).
        data_parallel_rank: which replica this engine core is (set by the API process for each core it starts).
        data_parallel_routing: how the API process picks a replica for a request: ``prefix`` (the replica
            holding the longest prefix of the prompt's blocks, weighed against its load), ``round-robin``,
            ``least-loaded``.
    """

    tensor_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    torchrun_rank: int | None = None
    data_parallel_size: int = 1
    data_parallel_rank: int = 0
    data_parallel_routing: str = "prefix"

    def __post_init__(self) -> None:
        tp, n = self.tensor_parallel_size, self.nnodes
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}")
        if not 0 <= self.data_parallel_rank < self.data_parallel_size:
            raise ValueError(f"data_parallel_rank must be in 0..{self.data_parallel_size - 1}, "
                             f"got {self.data_parallel_rank}")
        if self.data_parallel_routing not in DP_ROUTING_POLICIES:
            raise ValueError(f"data_parallel_routing must be one of {', '.join(DP_ROUTING_POLICIES)}, "
                             f"got {self.data_parallel_routing!r}")
        if tp < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {tp}")
        if n < 1:
            raise ValueError(f"nnodes must be >= 1, got {n}")
        if not 0 <= self.node_rank < n:
            raise ValueError(f"node_rank must be in 0..{n - 1} (nnodes {n}), got {self.node_rank}")
        if tp % n:
            raise ValueError(f"tensor_parallel_size {tp} is not a multiple of nnodes {n} (ranks per node)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ValueError(f"master_port must be in 1..65535, got {self.master_port}")
        if n > 1 and self.master_port is None:
            object.__setattr__(self, "master_port", 29500)  # torch's default
        if self.torchrun_rank is not None and not 0 <= self.torchrun_rank < tp:
            raise ValueError(f"torchrun RANK {self.torchrun_rank} not in 0..{tp - 1} (WORLD_SIZE)")

    @classmethod
    def from_torchrun_env(cls, env: "dict[str, str] | os._Environ" = os.environ, **kw: Any) -> "ParallelConfig":
        """The config of a process torchrun started (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``
        set: one process per rank, ``WORLD_SIZE`` = the tensor-parallel size); without them, ``kw`` as given.

        Raises:
            ValueError: ``WORLD_SIZE`` differs from an explicit ``tensor_parallel_size`` > 1; bad values.
        """
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls(**kw)
        world, tp = int(env["WORLD_SIZE"]), kw.get("tensor_parallel_size", 1)
        if tp not in (1, world):
            raise ValueError(f"--tensor-parallel-size {tp} != torchrun's WORLD_SIZE {world}")
        return cls(**{**kw, "tensor_parallel_size": world, "torchrun_rank": int(env["RANK"]),
                      "master_addr": env.get("MASTER_ADDR", "127.0.0.1"),
                      "master_port": int(env.get("MASTER_PORT", 29500)), "nnodes": 1, "node_rank": 0})

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    def pipe_ranks(self) -> list[int]:
        """The ranks this process spawns and drives through pipes: on node 0 (the engine), rank 0 alone under
        torchrun, else ``0 .. tp/nnodes - 1``; on another node, its own ranks (run headless)."""
        if self.torchrun_rank is not None:
            return [self.torchrun_rank]
        k = self.ranks_per_node
        return list(range(self.node_rank * k, (self.node_rank + 1) * k))

    @property
    def pipe_ranks_node0(self) -> int:
        """How many ranks node 0's engine reaches by pipe (the others get each call from rank 0 over gloo)."""
        return 1 if self.torchrun_rank is not None else self.ranks_per_node

    @property
    def headless(self) -> bool:
        """This process runs ranks only: no API server, no engine core (node rank > 0, torchrun rank > 0)."""
        return (self.torchrun_rank or 0) > 0 or self.node_rank > 0


SPEC_METHODS = ("ngram", "suffix")
MAX_NUM_SPECULATIVE_TOKENS = 16
"""Cap on ``num_speculative_tokens``: a draft longer than this costs more rows than it can save on a
model this small (a verify step's cost grows with its rows; see docs/speculative-decoding.md)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config`` JSON / ``LLM(speculative_config={...})``), vLLM's keys.

    Attributes:
        method: ``ngram`` (prompt lookup: the last n tokens of a request matched against its own prompt
            and output) or ``suffix`` (SuffixDecoding: suffix trees over the request and over recent
            outputs, Oliaro et al., NeurIPS 2025).
        num_speculative_tokens: most draft tokens per request per step (1..``MAX_NUM_SPECULATIVE_TOKENS``).
            ``suffix``: the cap of its variable-length speculation (default ``suffix_decoding_max_tree_depth``).
        prompt_lookup_min / prompt_lookup_max: ``ngram``: the shortest / longest suffix (tokens) matched.
        suffix_decoding_max_tree_depth: ``suffix``: depth of the suffix trees (tokens), which bounds
            both the matched context and the speculation.
        suffix_decoding_max_cached_requests: ``suffix``: finished requests whose outputs the global tree
            keeps (oldest dropped first); 0 turns the global tree off.
        suffix_decoding_max_spec_factor: ``suffix``: speculate at most this many tokens per matched token.
        suffix_decoding_min_token_prob: ``suffix``: stop a draft where the path's estimated probability
            (product of child frequency ratios) falls below this.
        disable_by_batch_size: no speculation in a step with at least this many running requests (vLLM's
            key); None: the cost model alone decides (:mod:`tinyvllm.spec_decode.policy`).
        cost_model: choose each step's draft lengths from measured step times and acceptance rates
            (True, the default), or always propose up to ``num_speculative_tokens`` (False).
    """

    method: str = "ngram"
    num_speculative_tokens: int | None = None
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 1000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    disable_by_batch_size: int | None = None
    cost_model: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise ValueError(f"speculative_config: method must be one of {', '.join(SPEC_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if k is None:
            k = 5 if self.method == "ngram" else min(self.suffix_decoding_max_tree_depth, MAX_NUM_SPECULATIVE_TOKENS)
            object.__setattr__(self, "num_speculative_tokens", k)
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be an integer in "
                             f"1..{MAX_NUM_SPECULATIVE_TOKENS}, got {k!r}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 2, 5
        elif lo is None:
            lo = min(2, hi) if isinstance(hi, int) else hi
        elif hi is None:
            hi = max(lo, 5) if isinstance(lo, int) else lo
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"speculative_config: {name} must be an integer >= 1, got {v!r}")
        if lo > hi:
            raise ValueError(f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if not isinstance(self.suffix_decoding_max_tree_depth, int) or not 1 <= self.suffix_decoding_max_tree_depth <= 256:
            raise ValueError(f"speculative_config: suffix_decoding_max_tree_depth must be an integer in 1..256, "
                             f"got {self.suffix_decoding_max_tree_depth!r}")
        if not isinstance(self.suffix_decoding_max_cached_requests, int) or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_cached_requests must be an integer >= 0, "
                             f"got {self.suffix_decoding_max_cached_requests!r}")
        if not isinstance(self.suffix_decoding_max_spec_factor, (int, float)) or self.suffix_decoding_max_spec_factor <= 0:
            raise ValueError(f"speculative_config: suffix_decoding_max_spec_factor must be > 0, "
                             f"got {self.suffix_decoding_max_spec_factor!r}")
        if not isinstance(self.suffix_decoding_min_token_prob, (int, float)) or \
                not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError(f"speculative_config: suffix_decoding_min_token_prob must be in [0, 1], "
                             f"got {self.suffix_decoding_min_token_prob!r}")
        b = self.disable_by_batch_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"speculative_config: disable_by_batch_size must be an integer >= 1, got {b!r}")

    @classmethod
    def parse(cls, value: "SpeculativeConfig | dict | str | None") -> "SpeculativeConfig | None":
        """``--speculative-config`` (a JSON object), ``LLM(speculative_config=dict)`` or a config; None: off.

        Raises:
            ValueError: not JSON, not an object, an unknown key, or a bad value (the message names it).
        """
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str) and not value.strip():
            return None
        value = _json_object(value, "speculative_config")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        if "method" not in value:
            raise ValueError("speculative_config: method is required (ngram or suffix)")
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative_config: SpeculativeConfig | None = None
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat vLLM-style keyword arguments (``block_size=32, max_num_seqs=8``...): the
        :class:`EngineArgs` fields.

        Raises:
            TypeError: an unknown option name.
            ValueError: an invalid option value.
        """
        return EngineArgs.from_kwargs(**kwargs).create_engine_config()


# ----------------------------------------------------------------------------- engine arguments

_CONFIG_PARTS = (ModelConfig, CacheConfig, SchedulerConfig)  # each EngineArgs field goes to exactly one


_FLAG_ALIASES = {"tensor_parallel_size": ("-tp",), "data_parallel_size": ("-dp",),  # vLLM's short flags
                 "data_parallel_routing": ("--dp-routing",)}


def _option(default: Any, help: str, *, choices: tuple[str, ...] | None = None,
            group: str | None = "engine") -> Any:
    """An :class:`EngineArgs` field: its default (the config's), its ``--help`` text, its choices, and
    the argument group its flag joins (``None``: no flag, a Python-API option only)."""
    return field(default=default, metadata={"help": help, "choices": choices, "group": group})


@dataclass
class EngineArgs:
    """Every engine option, once: the source of the CLI flags and of the configs.

    A field's name is the keyword of ``LLM(...)`` and, with ``-`` for ``_``, the flag (``block_size`` ->
    ``--block-size``); its type gives the flag's ``type`` (``bool``: ``--flag`` when the default is False,
    ``--flag/--no-flag`` when it is True); its metadata holds the help text, the choices and the argument
    group. :meth:`create_engine_config` hands each field to the config that has a field of that name
    (:class:`ModelConfig`, :class:`CacheConfig` or :class:`SchedulerConfig`), which validates it.

    Adding an option: a field (with its validation) on the config that uses it, and a field here whose
    default is that config's; the flag, ``LLM(option=...)``, ``tinyvllm serve|generate|chat|bench`` all follow.
    """

    model: str = _option(ModelConfig.model, "alias (SmolLM2-135M-Instruct), path to a .gguf file, or a Hugging "
                                            "Face model directory")
    dtype: str = _option(ModelConfig.dtype, "auto (bfloat16), bfloat16 or float32")
    max_model_len: int | None = _option(ModelConfig.max_model_len, "max tokens per sequence (prompt + output)")
    block_size: int = _option(CacheConfig.block_size, "tokens per KV block")
    max_num_seqs: int = _option(SchedulerConfig.max_num_seqs, "max running requests per step")
    max_num_batched_tokens: int = _option(SchedulerConfig.max_num_batched_tokens, "token budget per step")
    enable_prefix_caching: bool = _option(CacheConfig.enable_prefix_caching,
                                          "reuse KV blocks of identical prefixes across requests")
    kv_cache_memory: int | str = _option(CacheConfig.kv_cache_memory, "KV cache budget, e.g. 1GiB, 512MiB")
    num_kv_blocks: int | None = _option(CacheConfig.num_kv_blocks,
                                        "explicit number of KV blocks (overrides memory)")
    kv_offload_size: int | str = _option(CacheConfig.kv_offload_size,
                                         "KV offload tier for blocks the pool evicts, e.g. 8GiB (host RAM, or "
                                         "the file under --kv-offload-path); 0: off")
    kv_offload_path: str | None = _option(CacheConfig.kv_offload_path,
                                          "directory of a disk KV offload tier of --kv-offload-size bytes "
                                          "that survives restarts")
    kv_transfer_config: str | None = _option(CacheConfig.kv_transfer_config,
                                             "KV connector as JSON (vLLM's flag), e.g. '{\"kv_connector\": "
                                             "\"ZmqConnector\", \"kv_role\": \"kv_both\"}': prefill/decode "
                                             "disaggregation behind vllm-router (docs/disaggregation.md)")
    kv_events_config: str | None = _option(CacheConfig.kv_events_config,
                                           "publish KV cache events as JSON (vLLM's flag), e.g. "
                                           "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
                                           "\"endpoint\": \"tcp://*:5557\"}': BlockStored / BlockRemoved / "
                                           "AllBlocksCleared over ZMQ PUB, msgpack (for KV-aware routers)")
    kv_cache_dtype: str = _option(CacheConfig.kv_cache_dtype,
                                  "KV cache element type: auto (the model dtype), bfloat16, int8 or fp8 (= fp8_e4m3); "
                                  "int8/fp8 hold ~1.94x the tokens (docs/kv-cache-dtype.md)",
                                  choices=KV_CACHE_DTYPES)
    scheduling_policy: str = _option(SchedulerConfig.scheduling_policy,
                                     "continuous: rebuild the batch every step; static: admit a new batch only "
                                     "when one finishes", choices=SCHEDULING_POLICIES)
    seed: int = _option(ModelConfig.seed, "seed of unseeded sampling (and of --load-format dummy)")
    device: str = _option(ModelConfig.device, "auto (CUDA if available, else CPU), cpu, cuda or cuda:N")
    enforce_eager: bool = _option(ModelConfig.enforce_eager,
                                  "on CUDA, run every step eagerly (no CUDA-graph capture of the decode step)")
    load_format: str = _option(ModelConfig.load_format,
                               "auto: read the model's weights; dummy: seeded random weights of the shapes in "
                               "config.json (a directory with config.json and tokenizer files is enough; for "
                               "benchmarks)", choices=LOAD_FORMATS)
    quantization: str = _option(ModelConfig.quantization,
                                "auto (default): a quantized GGUF (Q8_0/Q4_0/Q4_1/Q4_K/Q6_K) runs on its blocks "
                                "natively where that is faster (bfloat16 on a CPU without AVX512-BF16); none: "
                                "dequantize at load; gguf: native, or an error",
                                choices=QUANTIZATION_MODES)
    enable_chunked_prefill: bool = _option(SchedulerConfig.enable_chunked_prefill,
                                           "split prompts longer than the step's remaining token budget",
                                           group=None)
    speculative_config: str | dict | None = _option(
        None, "speculative decoding, a JSON object with vLLM's keys, e.g. '{\"method\": \"ngram\", "
              "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 5}' or '{\"method\": \"suffix\"}' "
              "(docs/speculative-decoding.md)")
    tensor_parallel_size: int = _option(ParallelConfig.tensor_parallel_size, "ranks that each hold a share of every layer (vLLM's flag, also -tp): "
                                           "one worker process per rank in a torch.distributed group (gloo on the "
                                           "CPU, NCCL on CUDA); docs/parallelism.md")
    nnodes: int = _option(ParallelConfig.nnodes, "nodes of a multi-node tensor-parallel group (torchrun's flag); every node runs the "
                             "same command with its --node-rank; node 0 serves HTTP")
    node_rank: int = _option(ParallelConfig.node_rank, "this node's index in 0..nnodes-1 (torchrun's flag); > 0 runs only its ranks")
    master_addr: str = _option(ParallelConfig.master_addr, "address of node 0, where rank 0 hosts the group's store "
                                            "(torchrun's flag)")
    master_port: int | None = _option(ParallelConfig.master_port, "port of the group's store on --master-addr (torchrun's flag; "
                                            "default: a free port on one node, 29500 across nodes)")
    # Server options (the offline engine has no waiting-queue bound, one engine core): ``serve``'s server group.
    data_parallel_size: int = _option(ParallelConfig.data_parallel_size,
                                      "engine replicas behind this one API server (vLLM's flag, also -dp): N "
                                      "engine-core processes, each with its own KV cache and prefix cache and "
                                      "cores/N threads; requests go to the replica holding the longest prefix of "
                                      "their prompt, weighed against its load (docs/parallelism.md)",
                                      group="server")
    data_parallel_routing: str = _option(ParallelConfig.data_parallel_routing,
                                         "with --data-parallel-size > 1: prefix (prefix-cache aware, the default), "
                                         "round-robin, or least-loaded (fewest outstanding requests)",
                                         choices=DP_ROUTING_POLICIES, group="server")
    max_waiting_requests: int | None = _option(SchedulerConfig.max_waiting_requests,
                                               "answer 503 while this many requests are waiting for the engine "
                                               "(none: unbounded)", group="server")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineArgs":
        """``EngineArgs(**kwargs)``, naming an unknown option in the message.

        Raises:
            TypeError: an unknown option name.
        """
        names = {f.name for f in dataclasses.fields(cls)}
        for key in kwargs:
            if key not in names:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser | argparse._ArgumentGroup, group: str = "engine"
                     ) -> None:
        """Add one flag per field of ``group``: the engine flags go into a new ``engine`` argument group of
        ``parser``; the flags of any other group (``server``) are added to ``parser`` itself (the caller's
        argument group of that name)."""
        target = parser.add_argument_group("engine") if group == "engine" else parser
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.metadata["group"] != group:
                continue
            flag = "--" + f.name.replace("_", "-")
            kw: dict[str, Any] = {"default": f.default, "help": f.metadata["help"]}
            kind = _flag_type(hints[f.name])
            if kind is bool:
                kw["action"] = argparse.BooleanOptionalAction if f.default else "store_true"
            elif kind is not None:
                kw["type"] = kind
            if f.metadata["choices"] is not None:
                kw["choices"] = list(f.metadata["choices"])
            target.add_argument(flag, *_FLAG_ALIASES.get(f.name, ()), **kw)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "EngineArgs":
        """The fields parsed into ``args``; a field without a flag in that parser keeps its default."""
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})

    def create_engine_config(self) -> EngineConfig:
        """The validated configs.

        Raises:
            ValueError: an invalid option value.
        """
        parts = [klass(**{f.name: getattr(self, f.name) for f in dataclasses.fields(klass)})
                 for klass in _CONFIG_PARTS]
        parallel = ParallelConfig.from_torchrun_env(
            tensor_parallel_size=self.tensor_parallel_size, nnodes=self.nnodes, node_rank=self.node_rank,
            master_addr=self.master_addr, master_port=self.master_port,
            data_parallel_size=self.data_parallel_size, data_parallel_routing=self.data_parallel_routing)
        return EngineConfig(*parts, speculative_config=SpeculativeConfig.parse(self.speculative_config),
                            parallel_config=parallel)


def _flag_type(hint: Any) -> type | None:
    """The argparse ``type`` of a field's type: ``X | None`` -> ``X``; a union of several types -> ``None``
    (the string as given: the config parses it, e.g. ``kv_cache_memory``)."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0] if len(args) == 1 else None
    return None if hint is str else hint
