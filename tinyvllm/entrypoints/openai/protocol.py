"""OpenAI-compatible request models (pydantic), with vLLM's extensions.

Requests accept the OpenAI fields plus vLLM's sampling extensions (``top_k``,
``min_p``, ``repetition_penalty``, ``stop_token_ids``, ``ignore_eos``,
``min_tokens``, ``skip_special_tokens``, ``include_stop_str_in_output``...).
Unknown fields are ignored with a warning in the log (as vLLM does); known
fields that are not implemented (:data:`UNSUPPORTED_FIELDS`) are answered 400.
Text that is not valid Unicode (a lone UTF-16 surrogate such as ``"\ud800"``,
which JSON allows) is answered 400 naming the field. Types are strict (pydantic strict mode, see
:class:`OpenAIBaseModel`): a boolean field takes only JSON ``true``/``false``, an integer field only a JSON
integer (not ``"16"``, not ``16.0``, not ``true``), a float field a JSON number (an integer such as
``"temperature": 1`` is accepted, as in OpenAI) but not a string; anything else is a 400 naming the field.
Value ranges are
checked by :class:`~tinyvllm.sampling_params.SamplingParams`, whose
``ValueError`` names the field (the server answers 400 with ``param`` set).
Responses are plain dicts encoded with msgspec in
the ``tinyvllm.entrypoints.openai.serving_*`` modules.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from tinyvllm import envs
from tinyvllm.engine.input_processor import InvalidRequestError
from tinyvllm.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger("tinyvllm.api_server")


def find_unencodable(value: Any, path: str = "") -> tuple[str, int] | None:
    """The path (``messages[0].content``) and character index of the first string in a JSON value that UTF-8
    cannot encode (a lone surrogate), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return path, e.start
        return None
    if isinstance(value, dict):
        for k, v in value.items():
            key = str(k)
            if (hit := find_unencodable(key, path)) is not None:
                return hit
            if (hit := find_unencodable(v, f"{path}.{key}" if path else key)) is not None:
                return hit
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            if (hit := find_unencodable(v, f"{path}[{i}]")) is not None:
                return hit
    return None


def json_type(value: Any) -> str:
    """What a JSON value is, for messages (``a string "false"``, ``the integer 1``)."""
    if isinstance(value, bool):
        return f"the boolean {str(value).lower()}"
    if isinstance(value, int):
        return f"the integer {value}" if abs(value) < 10**20 else "an integer"
    if isinstance(value, float):
        return f"the number {value!r}"
    if isinstance(value, str):
        return f"the string {json.dumps(value, ensure_ascii=False)}" if len(value) <= 40 else "a string"
    if value is None:
        return "null"
    return "an array" if isinstance(value, (list, tuple)) else "an object" if isinstance(value, dict) \
        else type(value).__name__


class UnsupportedFieldError(ValueError):
    """A request field this server knows but does not implement (or a value over a server limit);
    ``param`` names it. Answered 400."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


class OpenAIBaseModel(BaseModel):
    """Base of every request model: unknown fields ignored (logged), text checked for lone surrogates, and
    pydantic's strict mode, so no value is coerced from another JSON type (``"parallel_tool_calls": "false"``,
    ``"max_tokens": "16"``, ``"stream": 1``, ``"n": 2.0`` are 400s, not honoured). A JSON integer is a
    valid float (``"temperature": 1``). Fields that stay lax on purpose are free-form objects the server
    passes on rather than reads as typed values: ``chat_template_kwargs`` (the template decides what its
    variables mean), ``structured_outputs`` (checked by :class:`StructuredOutputsParams`, which takes no
    coerced values either), ``response_format`` / ``tools`` / ``tool_choice`` (checked by hand where they are
    read: ``response_format.json_schema.strict`` and ``tools[].function.strict`` must be booleans) and the
    extra keys of a chat message (``tool_calls``...)."""

    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="wrap")
    @classmethod
    def _check_text_and_log_unknown(cls, data: Any, handler: Any) -> Any:
        if isinstance(data, dict):
            if (hit := find_unencodable(data)) is not None:
                path, index = hit
                raise PydanticCustomError(
                    "unencodable_text", "{field}: the text is not valid Unicode (a lone surrogate at character "
                    "{index}); send UTF-8 text", {"field": path or "body", "index": index})
            unknown = sorted(k for k in data if k not in cls.model_fields and isinstance(k, str))
            if unknown:
                logger.warning("%s: the following fields were present in the request but ignored: %s",
                               cls.__name__, unknown)
        return handler(data)


# ----------------------------------------------------------------------------- shared


class StreamOptions(OpenAIBaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


# Known fields (OpenAI's or vLLM's) that this server does not implement: a request that uses one gets a 400
# naming it, rather than a 200 as if it had been honoured (``field -> reason``).
UNSUPPORTED_FIELDS: dict[str, str] = {
    "suffix": "suffix (insertion) is not supported",
    "use_beam_search": "beam search is not supported",
    "functions": "function calling is not supported",
    "function_call": "function calling is not supported",
    "audio": "audio output is not supported",
    "prediction": "predicted outputs are not supported",
}
# Values of an unsupported field that mean "not used" (accepted silently).
_UNUSED_VALUES: tuple[Any, ...] = (None, False, "", [], {}, "none")


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
    spaces_between_special_tokens: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[str, float] | None = None
    best_of: int | None = None
    user: str | None = None
    # Extension: return usage.prefix_cache (matched blocks, miss reason, divergence); see docs/observability.md.
    prefix_cache_debug: bool = False

    use_beam_search: bool | None = None

    prompt_logprobs: int | None = None

    # vLLM's extension: {"json": schema} | {"regex": str} | {"choice": [str]} | {"grammar": EBNF}
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None  # vLLM's field: isolates this request's prefix-cache / offload blocks
    # vLLM's field (P/D disaggregation behind vllm-router): {"do_remote_decode": true} on a prefill request,
    # the prefill response's kv_transfer_params on a decode request (docs/disaggregation.md).
    kv_transfer_params: dict[str, Any] | None = None

    def _check_unsupported(self) -> None:
        for name, reason in UNSUPPORTED_FIELDS.items():
            if name in type(self).model_fields and getattr(self, name) not in _UNUSED_VALUES:
                raise UnsupportedFieldError(f"{name}: {reason}", name)
        limit = envs.TINYVLLM_MAX_N_SEQUENCES
        if self.n > limit:
            raise UnsupportedFieldError(f"n must be <= {limit} (TINYVLLM_MAX_N_SEQUENCES), got {self.n}", "n")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError(f"best_of must equal n (best_of > n is not supported), got {self.best_of}")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")

    def _structured(self) -> tuple[StructuredOutputsParams | None, str]:
        """The output constraint and the request field it came from (for 400s)."""
        so = self.structured_outputs
        if so is None:
            return None, "structured_outputs"
        allowed = {"json", "regex", "choice", "grammar"}
        given = {k: v for k, v in so.items() if v is not None}
        if unknown := sorted(set(given) - allowed):
            raise InvalidRequestError(f"structured_outputs: unsupported key(s) {unknown}; use one of "
                                      f"{sorted(allowed)}", "structured_outputs")
        try:
            return StructuredOutputsParams(**given), "structured_outputs"
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None,
                         prompt_logprobs: int | None = None,
                         structured: StructuredOutputsParams | None = None) -> SamplingParams:
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
            include_stop_str_in_output=self.include_stop_str_in_output,
            prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else self.prompt_logprobs,
            logit_bias=self.logit_bias, structured_outputs=structured, cache_salt=self.cache_salt,
            extra_args=self._kv_transfer_extra_args(), **kw,
        )

    def _kv_transfer_extra_args(self) -> dict[str, Any] | None:
        """``kv_transfer_params`` as ``SamplingParams.extra_args`` (vLLM's place for them), checked."""
        p = self.kv_transfer_params
        if p is None:
            return None
        for key in ("do_remote_decode", "do_remote_prefill"):
            if p.get(key) is not None and not isinstance(p[key], bool):
                raise InvalidRequestError(f"kv_transfer_params.{key} must be a boolean", "kv_transfer_params")
        if self.n != 1:  # n samples: each engine computes the prompt itself (the tokens are the same either way)
            logger.info("kv_transfer_params ignored for a request with n = %d", self.n)
            return None
        return {"kv_transfer_params": dict(p)}

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
        # echo + logprobs scores the prompt too (lm-eval's loglikelihood), as vLLM: prompt_logprobs = logprobs
        plp = None
        if self.echo and self.logprobs is not None:
            plp = max(self.logprobs, self.prompt_logprobs or 0)
        return self._sampling_params(self.max_tokens, self.logprobs, plp, self._structured()[0])


# ----------------------------------------------------------------------------- chat


class ChatMessage(BaseModel):
    """One chat message; extra keys (``tool_calls``...) are kept for the chat template. Strict types, as
    :class:`OpenAIBaseModel`. A ``tool`` message needs a ``tool_call_id`` that names a tool call of an
    earlier assistant message (checked with the whole conversation, in ``serving_engine``)."""

    model_config = ConfigDict(extra="allow", strict=True)

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None


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
    # Passed to the chat template as enable_thinking (Qwen3's switch), as chat_template_kwargs would be.
    enable_thinking: bool | None = None
    # OpenAI: {"type": "text" | "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None

    def _response_format(self) -> StructuredOutputsParams | None:
        rf = self.response_format
        if rf is None:
            return None
        kind = rf.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return StructuredOutputsParams(json_object=True)
        if kind == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("name"), str):
                raise InvalidRequestError("response_format.json_schema must be an object with a 'name' "
                                          "and a 'schema'", "response_format")
            if js.get("strict") is not None and not isinstance(js["strict"], bool):
                raise InvalidRequestError(f"response_format.json_schema.strict must be a boolean (true or false), "
                                          f"got {json_type(js['strict'])}", "response_format")
            schema = js.get("schema", {})
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError("response_format.json_schema.schema must be a JSON schema object",
                                          "response_format")
            return StructuredOutputsParams(json=schema)
        raise InvalidRequestError(f"response_format.type must be 'text', 'json_object' or 'json_schema', "
                                  f"got {kind!r}", "response_format")

    def structured_outputs_and_param(self, tool_tag: str | None) -> tuple[StructuredOutputsParams | None, str]:
        """The constraint (from the tools, ``response_format`` or ``structured_outputs``; at most one) and
        the field a bad one is reported under."""
        sources = []
        if tool_tag is not None:
            sources.append((StructuredOutputsParams(structural_tag=tool_tag), "tools"))
        if (rf := self._response_format()) is not None:
            sources.append((rf, "response_format"))
        so, param = self._structured()
        if so is not None:
            sources.append((so, param))
        if len(sources) > 1:
            raise InvalidRequestError(f"only one of tools (with tool_choice other than 'none'), response_format "
                                      f"and structured_outputs may constrain the output; got "
                                      f"{', '.join(p for _, p in sources)}", sources[1][1])
        return sources[0] if sources else (None, "structured_outputs")

    def to_sampling_params(self, tool_tag: str | None = None) -> SamplingParams:
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs requires logprobs to be true")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, structured=self.structured_outputs_and_param(tool_tag)[0])


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
