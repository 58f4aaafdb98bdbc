"""Every message between the API process and the engine core process, typed (msgspec structs).

The wire format is two ZMQ frames: a one-byte type tag and a msgpack payload.

API → core (:class:`EngineCoreRequestType`):
    ``ADD`` a list of :class:`EngineCoreRequest`; ``ABORT`` a list of request ids;
    ``RESET_PREFIX_CACHE`` and ``SHUTDOWN`` with an empty payload.
core → API (:class:`EngineCoreOutputType`):
    ``READY`` one :class:`EngineCoreReady` when the model is loaded; ``OUTPUTS`` an
    :class:`EngineCoreOutputs` after every step (and after any message that changed
    the core's state); ``ERROR`` one :class:`EngineCoreError`, after which the core exits.

The offline engine (:class:`~tinyvllm.engine.llm_engine.LLMEngine`) calls the
same :class:`~tinyvllm.engine.core.EngineCore` in-process with the same types.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from tinyvllm.metrics.kv_stats import PrefixCacheReport
from tinyvllm.metrics.stats import IterationStats, SchedulerStats
from tinyvllm.outputs import TokenLogprobs
from tinyvllm.sampling_params import SamplingParams


class EngineCoreRequestType(enum.Enum):
    """First frame of a message to the engine core."""

    ADD = b"\x00"
    ABORT = b"\x01"
    RESET_PREFIX_CACHE = b"\x02"
    SHUTDOWN = b"\x03"


class EngineCoreOutputType(enum.Enum):
    """First frame of a message from the engine core."""

    READY = b"\x10"
    OUTPUTS = b"\x11"
    ERROR = b"\x12"


# The output tags as bytes, for comparing a received first frame without building an enum per message.
READY_TAG, OUTPUTS_TAG, ERROR_TAG = (EngineCoreOutputType.READY.value, EngineCoreOutputType.OUTPUTS.value,
                                     EngineCoreOutputType.ERROR.value)


class EngineCoreRequest(msgspec.Struct, array_like=True):
    """One sequence to generate (an ``n > 1`` request is ``n`` of these, see
    :func:`~tinyvllm.engine.input_processor.fan_out`).

    Attributes:
        request_id: engine-side id (``parent#i`` for sample ``i`` of ``n``).
        prompt_token_ids: the prompt, checked by the input processor.
        eos_token_ids: ids that end the sequence.
        arrival_time: ``time.monotonic()`` of arrival in the front end (seconds).
        prefix_cache_debug: return a prefix-cache report (``EngineCoreOutput.prefix_cache``).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float = 0.0
    prefix_cache_debug: bool = False


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """One sequence's progress in one step: its new token(s), and its finish if it finished.

    The KV cost so far travels with every output (a stop string may end the request in the API
    process at any step): ``kv_block_seconds`` (blocks x seconds, shared blocks split between their
    holders), ``peak_kv_blocks``, ``num_prefill_computed`` / ``num_prefill_cached`` (tokens).
    ``prefix_cache`` (only with ``prefix_cache_debug``) comes with the first output.
    """

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    kv_block_seconds: float = 0.0
    peak_kv_blocks: int = 0
    num_prefill_computed: int = 0
    num_prefill_cached: int = 0
    prefix_cache: PrefixCacheReport | None = None
    prompt_logprobs: list[TokenLogprobs] | None = None  # prompt tokens 1..P-1, with the first output token
    num_cached_tokens_tier: int = 0  # the part of num_cached_tokens loaded from the KV offload tier
    kv_transfer_params: dict[str, Any] | None = None  # P/D: what a decode engine needs to pull this request's KV


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    """One ``OUTPUTS`` message: a step's outputs, rejected adds, and the engine's stats.

    Attributes:
        outputs: per-sequence new tokens / finishes of the step (may be empty).
        rejected: ``(request_id, error message)`` of requests the core refused.
        scheduler_stats: queue and KV gauges and cumulative counters after the step.
        iteration_stats: the step itself (None when no step ran, e.g. after an abort).
        timestamp: ``time.monotonic()`` when sent (seconds).
    """

    outputs: list[EngineCoreOutput] = []
    rejected: list[tuple[str, str]] = []
    scheduler_stats: SchedulerStats | None = None
    iteration_stats: IterationStats | None = None
    timestamp: float = 0.0


class EngineCoreReady(msgspec.Struct):
    """The ``READY`` message: the loaded engine, as the API process needs it.

    Attributes:
        pid: the core process's pid.
        max_model_len: longest sequence served (tokens), after capping to the KV capacity.
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        eos_token_id: the model config's EOS id(s).
        num_kv_blocks / block_size: the KV pool.
        load_seconds: model load and KV allocation time.
        served_name: the model's own name.
        dtype: the weights' and KV cache's dtype (``bfloat16``, ``float32``...).
        quantization: how the linears run: ``none`` (dense weights in ``dtype``) or ``gguf`` (on the
            GGUF file's quantized blocks, :mod:`tinyvllm.model.gguf_quant`).
    """

    pid: int
    max_model_len: int
    vocab_size: int
    eos_token_id: int | list[int] | None
    num_kv_blocks: int
    block_size: int
    load_seconds: float
    served_name: str
    dtype: str = ""
    quantization: str = ""


class EngineCoreError(msgspec.Struct):
    """The ``ERROR`` message: why the core stopped (``Type: message``, maybe a traceback)."""

    message: str


_encoder = msgspec.msgpack.Encoder()


def encode(obj: Any) -> bytes:
    """msgpack bytes of a message payload."""
    return _encoder.encode(obj)
