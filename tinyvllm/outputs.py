"""Results returned to users: :class:`RequestOutput` holding one :class:`CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw distribution."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# Per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    """One generated sequence.

    Attributes:
        index: which of the ``n`` samples this is.
        text: generated text (stop string excluded unless ``include_stop_str_in_output``).
        token_ids: generated token ids.
        cumulative_logprob: sum of the sampled tokens' logprobs (when logprobs were requested).
        logprobs: per token, when ``SamplingParams.logprobs`` is set.
        finish_reason: ``"stop"``, ``"length"``, ``"abort"`` or ``None`` while running.
        stop_reason: the stop string or stop token id that ended it, if any.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Timings (seconds, ``time.monotonic``) and token counts of one request."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    """The output of one request (``n`` samples share the prompt).

    ``prompt_logprobs`` (when asked for): one entry per prompt token, ``None`` for the first (nothing
    precedes it), else token id -> :class:`Logprob` (the prompt token and the top ones), as vLLM's.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)
    # On the finished output: the KV cost summed over the samples (``kv_block_seconds``, ``peak_kv_blocks``,
    # ``prefill_tokens_computed``, ``prefill_tokens_cached``), and the prefix-cache report
    # (``tinyvllm.metrics.kv_stats.PrefixCacheReport``, with ``prefix_cache_debug``), else None.
    kv_cost: dict | None = field(default=None, repr=False)
    prefix_cache: object | None = field(default=None, repr=False)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens_tier: int = 0  # the part of num_cached_tokens loaded from the KV offload tier
    # P/D disaggregation (vLLM's field): what the decode engine needs to pull this request's KV (on the
    # finished output of a request sent with kv_transfer_params {"do_remote_decode": true}), else None.
    kv_transfer_params: dict | None = None


# ----------------------------------------------------------------------------- worker -> scheduler


@dataclass
class TokenLogprobs:
    """Logprobs of one sampled token under the model's raw distribution.

    Attributes:
        token_id: the sampled token.
        logprob: its log-probability (natural log).
        rank: its rank in the distribution (1 = most likely).
        top: ``(token id, logprob)`` of the most likely tokens, most likely first.
    """

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]]


@dataclass
class KVConnectorOutput:
    """What a KV connector's worker half reports after a step (as vLLM v1's ``KVConnectorOutput``).

    Attributes:
        finished_sending: requests whose blocks were sent (or whose send was given up: released by the
            receiver, or expired): the scheduler frees the blocks it kept for them.
        finished_recving: requests whose blocks arrived: they may be scheduled.
        failed_recving: requests whose load failed: they recompute their prompt.
    """

    finished_sending: list[str] = field(default_factory=list)
    finished_recving: list[str] = field(default_factory=list)
    failed_recving: list[str] = field(default_factory=list)
    recv_bytes: int = 0  # bytes of the loads in finished_recving
    recv_seconds: float = 0.0  # their transfer time summed (request sent -> bytes in the KV cache)
    num_expired: int = 0  # sends in finished_sending given up because nobody pulled them within the TTL

    def __bool__(self) -> bool:
        return bool(self.finished_sending or self.finished_recving or self.failed_recving)


@dataclass
class ModelRunnerOutput:
    """What one step of the worker returns (as vLLM v1's ``ModelRunnerOutput``).

    Attributes:
        sampled: request id -> sampled token id, for the requests whose step reached
            the end of their known tokens (a finished prefill or a decode).
        logprobs: request id -> logprobs of that token, where the request asked for them.
        prompt_logprobs: request id -> logprobs of prompt tokens 1..P-1 (each under the logits of the
            position before it), sent once, with the request's first sampled token, for requests that
            asked for ``prompt_logprobs``.
        spec_accepted: request id -> the draft tokens it accepted this step (speculative decoding),
            emitted before ``sampled[id]``; only for requests that had drafts.
        spec_logprobs: request id -> logprobs of those accepted tokens, where the request asked for them.
    """

    sampled: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    spec_accepted: dict[str, list[int]] = field(default_factory=dict)
    spec_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    kv_connector_output: KVConnectorOutput | None = None  # the KV connector's transfers (None: no connector)
