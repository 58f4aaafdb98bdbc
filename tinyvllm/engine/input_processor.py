"""Checks a tokenized request against the engine's limits, and fans an ``n > 1`` request out into samples.

One implementation, used by the offline :class:`~tinyvllm.engine.llm_engine.LLMEngine`,
the API process's :class:`~tinyvllm.engine.async_llm.AsyncLLM` (before anything is
sent to the core) and the :class:`~tinyvllm.engine.core.EngineCore` itself (a
request arriving over IPC is checked again: the core must never fail on one).
"""

from __future__ import annotations

from typing import Sequence

from tinyvllm.engine.messages import EngineCoreRequest
from tinyvllm.sampling_params import SamplingParams


class InvalidRequestError(ValueError):
    """A request the engine cannot serve (e.g. a prompt too long); ``param`` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def check_prompt(prompt_token_ids: Sequence[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                 *, check_max_tokens: bool = False) -> None:
    """Raise :class:`InvalidRequestError` unless the engine can serve this prompt.

    Args:
        prompt_token_ids: the tokenized prompt.
        params: its sampling parameters.
        max_model_len: the engine's longest sequence (prompt + output, tokens).
        vocab_size: token ids must lie in ``[0, vocab_size)``.
        check_max_tokens: also reject ``prompt + max_tokens > max_model_len`` (the OpenAI
            server's rule); otherwise ``max_tokens`` is clipped to what fits (the offline rule).

    Raises:
        InvalidRequestError: empty prompt; a prompt that leaves no room for one generated
            token; with ``check_max_tokens``, prompt + ``max_tokens`` over ``max_model_len``;
            token ids (prompt or ``stop_token_ids``) that are not ints in the vocabulary.
    """
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if n >= max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length (max_model_len) is {max_model_len} tokens. However, your "
            f"prompt is {n} tokens, which leaves no room for a completion. Please reduce the length of the prompt.",
            "prompt")
    if check_max_tokens and params.max_tokens is not None and n + params.max_tokens > max_model_len:
        raise InvalidRequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} in the completion). "
            "Please reduce the length of the prompt or max_tokens.", "max_tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids):
        raise InvalidRequestError("prompt token ids must be a list of ints", "prompt")
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise InvalidRequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
    if params.stop_token_ids and max(params.stop_token_ids) >= vocab_size:
        raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab_size})", "stop_token_ids")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias keys must be token ids in [0, {vocab_size})", "logit_bias")


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Engine-side ids of the ``n`` samples of a request (the request id itself when n == 1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Per-sample params of an ``n > 1`` request: n=1, and seed+index when seeded."""
    p = params.clone()
    p.n = 1
    if params.seed is not None:  # wraps around within int64 (a seed near 2**63 - 1 stays representable)
        p.seed = (params.seed + index + 2**63) % 2**64 - 2**63
    return p


def fan_out(request_id: str, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: list[int],
            arrival_time: float) -> list[EngineCoreRequest]:
    """The engine requests of one user request: one per sample (``params.n``), ids from
    :func:`child_request_ids`, params from :func:`child_params` (unchanged when ``n == 1``)."""
    kids = child_request_ids(request_id, params.n)
    return [EngineCoreRequest(cid, list(prompt_token_ids), child_params(params, i) if len(kids) > 1 else params,
                              list(eos_token_ids), arrival_time) for i, cid in enumerate(kids)]
