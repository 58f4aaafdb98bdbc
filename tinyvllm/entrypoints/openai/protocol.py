"""OpenAI-compatible request and response models (pydantic), with vLLM's extensions.

Requests accept the OpenAI fields plus vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``...).
Unknown fields are ignored, as OpenAI-style servers do. Value ranges are
checked by :class:`~tinyvllm.sampling_params.SamplingParams`, whose
``ValueError`` names the field (the server answers 400 with ``param`` set).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinyvllm.sampling_params import SamplingParams


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# ----------------------------------------------------------------------------- errors


class ErrorInfo(OpenAIBaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(OpenAIBaseModel):
    error: ErrorInfo


# ----------------------------------------------------------------------------- shared


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class PromptTokensDetails(OpenAIBaseModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


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
            include_stop_str_in_output=self.include_stop_str_in_output, **kw,
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


class CompletionLogprobs(OpenAIBaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo


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


class ChatLogprobTop(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobToken(ChatLogprobTop):
    top_logprobs: list[ChatLogprobTop] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobToken] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatCompletionResponseChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo


# ----------------------------------------------------------------------------- models, tokenize


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tinyvllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeRequest(OpenAIBaseModel):
    """``POST /tokenize``: ``prompt`` (text) or ``messages`` (rendered with the chat template)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeResponse(OpenAIBaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(OpenAIBaseModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIBaseModel):
    prompt: str
