"""OpenAI-compatible request models (pydantic), with vLLM's extensions.

Requests accept the OpenAI fields plus vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``...).
Unknown fields are ignored, as OpenAI-style servers do. Value ranges are
checked by :class:`~tinyvllm.sampling_params.SamplingParams`, whose
``ValueError`` names the field (the server answers 400 with ``param`` set).
Responses are plain dicts encoded with msgspec in
the ``tinyvllm.entrypoints.openai.serving_*`` modules.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.sampling_params import SamplingParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------- shared


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingFields(OpenAIBaseModel):
    """Sampling fields shared by completions and chat completions."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's field: isolates this request's prefix-cache / offload blocks

    def _check_unsupported(self) -> None:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (best_of > n is not supported), got {self.best_of}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        kw: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if v is not None:
                kw[name] = v
        return SamplingParams(
            n=self.n, max_tokens=max_tokens, min_tokens=self.min_tokens, seed=self.seed, stop=self.stop,
            stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos, logprobs=logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output, cache_salt=self.cache_salt, **kw,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


# ----------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of strings, a list of token
    ids, or a list of token-id lists. ``max_tokens`` defaults to 16 as in OpenAI's and
    vLLM's completions API (``null`` = up to the end of the context)."""

    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = True

    def to_sampling_params(self) -> SamplingParams:
        if self.suffix:
            raise ValueError("suffix is not supported")
        return self._sampling_params(self.max_tokens, self.logprobs)


# ----------------------------------------------------------------------------- chat


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` (or the deprecated
    ``max_tokens``) defaults to the rest of the context."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def to_sampling_params(self) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs)


# ----------------------------------------------------------------------------- tokenize


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]
