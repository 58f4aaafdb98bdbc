"""Engine configuration: model, KV cache and scheduler settings (validated dataclasses).

Option names follow vLLM's engine arguments (``block_size``, ``max_num_seqs``,
``max_num_batched_tokens``, ``enable_prefix_caching``, ``max_model_len``...) so a
vLLM user's habits carry over.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

import torch

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
LOAD_FORMATS = ("auto", "dummy")

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype, device: str = "cpu") -> torch.dtype:
    """Map a dtype name (``auto``, ``bfloat16``, ``float32``, ...) to a torch dtype.

    ``auto`` is bfloat16 (fast on AVX-512 BF16 CPUs and on GPUs).

    Raises:
        ValueError: unknown dtype name.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower()
    if name == "auto":
        return torch.bfloat16
    if name not in _DTYPES:
        raise ValueError(f"dtype must be one of auto, {', '.join(sorted(_DTYPES))}; got {dtype!r}")
    return _DTYPES[name]


def parse_size(value: int | float | str) -> int:
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
            raise ValueError(f"kv_cache_memory: cannot parse size {value!r} (use e.g. '2GiB', '512MiB' or bytes)")
        num = float(m.group(1))
        unit = (m.group(2) or "").upper().rstrip("B").rstrip("I")
        mult = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}[unit]
        size = int(num * mult)
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be > 0 bytes, got {value!r}")
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


@dataclass
class ModelConfig:
    """What model to run and how.

    Attributes:
        model: alias (``SmolLM2-135M-Instruct``), path to a ``.gguf`` file, or a
            Hugging Face model directory (config.json + *.safetensors + tokenizer).
        dtype: ``auto`` (bfloat16), ``bfloat16`` or ``float32``.
        max_model_len: longest sequence (prompt + output, tokens); default the
            model's ``max_position_embeddings``.
        seed: seed of the default random generator (unseeded requests).
        device: ``cpu``, ``cuda`` (or ``cuda:N``) or ``auto`` (CUDA when
            ``torch.cuda.is_available()``, else CPU); resolved when the engine starts
            (:func:`resolve_device`).
        enforce_eager: never capture CUDA graphs (vLLM's flag); CUDA graphs of the
            decode step are used only on CUDA.
        load_format: ``auto`` (read the ``*.safetensors`` weights) or ``dummy``
            (vLLM's flag: seeded random weights of the shapes ``config.json`` gives;
            the directory needs no weight files; for benchmarks of a model's shape).
    """

    model: str = DEFAULT_MODEL
    dtype: str = "auto"
    max_model_len: int | None = None
    seed: int = 0
    device: str = "cpu"
    enforce_eager: bool = False
    load_format: str = "auto"

    def __post_init__(self) -> None:
        parse_dtype(self.dtype)
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        check_device_name(self.device)
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return parse_dtype(self.dtype, self.device)


@dataclass
class CacheConfig:
    """Paged KV cache settings.

    Attributes:
        block_size: tokens per KV block (PagedAttention page).
        kv_cache_memory: KV budget in bytes (or a string such as ``'1GiB'``); the
            number of blocks is ``kv_cache_memory // bytes_per_block``.
        num_kv_blocks: explicit number of blocks, overriding the memory budget
            (handy for tests that force preemption).
        enable_prefix_caching: reuse full blocks across requests by chained hash.
    """

    block_size: int = 16
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")


@dataclass
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
        if self.scheduling_policy not in ("continuous", "static"):
            raise ValueError(
                f"scheduling_policy must be 'continuous' or 'static', got {self.scheduling_policy!r}"
            )


@dataclass
class EngineConfig:
    model_config: ModelConfig = field(default_factory=ModelConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> "EngineConfig":
        """Build from flat vLLM-style keyword arguments (``block_size=32, max_num_seqs=8``...).

        Raises:
            TypeError: an unknown option name.
        """
        parts: dict[type, dict[str, Any]] = {ModelConfig: {}, CacheConfig: {}, SchedulerConfig: {}}
        for key, value in kwargs.items():
            for klass in parts:
                if key in {f.name for f in dataclasses.fields(klass)}:
                    parts[klass][key] = value
                    break
            else:
                raise TypeError(f"unknown engine option {key!r}")
        return cls(ModelConfig(**parts[ModelConfig]), CacheConfig(**parts[CacheConfig]),
                   SchedulerConfig(**parts[SchedulerConfig]))
