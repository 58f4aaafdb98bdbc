"""Per-request sampling parameters, validated on construction.

The field names, defaults and meanings follow vLLM's ``SamplingParams`` (and,
for the penalties, the OpenAI completions API), so client code written for
either reads the same here.  Every invalid value raises ``ValueError`` whose
message starts with the offending field's name, e.g.
``"temperature must be >= 0, got -1"``.
"""

from __future__ import annotations

import copy
import enum
import json as _json
import math
import numbers
from dataclasses import dataclass
from typing import Any

# Temperatures below this are treated as greedy decoding (argmax), as in vLLM.
SAMPLING_EPS: float = 1e-5
# Upper bound on the number of top logprobs a request may ask for per token.
MAX_LOGPROBS: int = 20
# Every integer field travels to the engine core as a msgpack int and into torch as int64 (the seed of a
# ``torch.Generator``, top-k as an int64 tensor): a value outside the signed 64-bit range is rejected here,
# as vLLM bounds ``seed`` by ``torch.iinfo(torch.long)``.
INT64_MIN: int = -(2**63)
INT64_MAX: int = 2**63 - 1


class SamplingType(enum.IntEnum):
    """How a request's next token is chosen."""

    GREEDY = 0       # argmax of the (penalised) logits
    RANDOM = 1       # random draw from the shared default generator
    RANDOM_SEED = 2  # random draw from the request's own seeded generator


def _check_int(name: str, value: Any, *, optional: bool = False) -> int | None:
    """Return ``value`` as an ``int``; bools and non-integers are rejected."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        kind = "an int or None" if optional else "an int"
        raise ValueError(f"{name} must be {kind}, got {value!r} ({type(value).__name__})")
    if not INT64_MIN <= value <= INT64_MAX:
        raise ValueError(f"{name} must be a signed 64-bit integer (in [-2**63, 2**63 - 1]), got {value}")
    return int(value)


def _check_float(name: str, value: Any) -> float:
    """Return ``value`` as a finite ``float``; bools, strings and NaN/inf are rejected."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
    result = float(value)
    if not math.isfinite(result):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return result


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {value!r} ({type(value).__name__})")
    return value


_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


@dataclass
class StructuredOutputsParams:
    """A request's output constraint (vLLM's ``StructuredOutputsParams``); exactly one field is set.

    Attributes:
        json: a JSON schema (a dict is normalised to its JSON text, key order kept).
        regex: a regular expression the whole output must match.
        choice: the output is exactly one of these strings.
        grammar: an EBNF grammar (xgrammar's dialect, GBNF-like; ``root`` is the start rule).
        json_object: any JSON object (OpenAI's ``response_format={"type": "json_object"}``).
        structural_tag: an xgrammar structural tag, as JSON text (tool calling uses it: free text
            until a trigger such as ``<tool_call>``, then the tools' argument schemas).

    The constraint is compiled by the engine core (``tinyvllm.structured_output``); the API server
    validates it first, so a bad one is a 400 naming the field.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.json, (dict, bool)):
            self.json = _json.dumps(self.json, ensure_ascii=False)  # key order kept: it is the output order
        if self.choice is not None:
            if not isinstance(self.choice, (list, tuple)) or not self.choice or not all(
                    isinstance(c, str) for c in self.choice):
                raise ValueError("structured_outputs.choice must be a non-empty list of strings")
            self.choice = list(self.choice)
        for name in ("json", "regex", "grammar", "structural_tag"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, str):
                raise ValueError(f"structured_outputs.{name} must be a string, got {type(v).__name__}")
        if not isinstance(self.json_object, bool):
            raise ValueError("structured_outputs.json_object must be a bool")
        set_ = [k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError(f"structured_outputs must set exactly one of {', '.join(_STRUCTURED_KINDS)}; "
                             f"got {set_ or 'none'}")

    @property
    def kind(self) -> str:
        """Which constraint: one of ``json, regex, choice, grammar, json_object, structural_tag``."""
        return next(k for k in _STRUCTURED_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, spec text)``: the compiled-grammar cache key."""
        kind = self.kind
        if kind == "choice":
            return kind, _json.dumps(self.choice, ensure_ascii=False)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (mirrors vLLM's ``SamplingParams``).

    Attributes:
        n: number of output sequences to generate for the prompt (>= 1).
        temperature: softmax temperature (>= 0); below ``SAMPLING_EPS`` means greedy.
        top_p: nucleus sampling mass, in (0, 1]; 1 disables it.
        top_k: keep only the k most likely tokens; 0 (or -1, normalised to 0) disables it.
        min_p: keep tokens whose probability is >= ``min_p * p_max``, in [0, 1]; 0 disables it.
        repetition_penalty: CTRL-style penalty (> 0) on tokens seen in the prompt or
            output; 1 disables it.
        presence_penalty: OpenAI presence penalty in [-2, 2] on generated tokens.
        frequency_penalty: OpenAI frequency penalty in [-2, 2] on generated tokens.
        max_tokens: maximum number of generated tokens (>= 1), or None to let the
            engine generate up to the model's context length.
        min_tokens: EOS and stop token ids are banned until this many tokens exist.
        seed: per-request random seed, or None to use the engine's shared generator.
        stop: strings that end generation (normalised to ``list[str]``).
        stop_token_ids: token ids that end generation (normalised to ``list[int]``).
        ignore_eos: keep generating past EOS.
        logprobs: number of top logprobs to return per generated token (0..20);
            0 returns only the sampled token's logprob; None returns none.
        prompt_logprobs: number of top logprobs per prompt token (>= 0), or None.
        skip_special_tokens: drop special tokens when detokenizing.
        spaces_between_special_tokens: with ``skip_special_tokens=False``, put a space between
            each added (special) token and the text around it, as Hugging Face's slow
            tokenizers decode. Off by default: a fast tokenizer's decode (and vLLM's fast
            detokenizer) joins them without spaces.
        include_stop_str_in_output: keep the matched stop string in the output text.
        logit_bias: token id -> bias in [-100, 100] added to that token's logit before sampling (OpenAI's
            ``logit_bias``; -100 effectively bans a token, 100 forces it). Logprobs are those of the biased
            distribution. Token ids are checked against the vocabulary by the engine.
        structured_outputs: a grammar the output must follow (:class:`StructuredOutputsParams`), or None.
        cache_salt: a non-empty string folded into the hash of the request's first KV block (vLLM's
            request field), so that it shares prefix-cached and offloaded blocks only with requests
            of the same salt (isolation between tenants); None shares with every unsalted request.
        extra_args: free-form arguments for plugins (vLLM's field); ``extra_args["kv_transfer_params"]`` carries
            a request's P/D disaggregation parameters to the KV connector (:mod:`tinyvllm.distributed.kv_transfer`).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int | None = 16
    min_tokens: int = 0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    structured_outputs: StructuredOutputsParams | None = None
    cache_salt: str | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # --- types (and normalisation to plain Python types) ---
        self.n = _check_int("n", self.n)
        self.temperature = _check_float("temperature", self.temperature)
        self.top_p = _check_float("top_p", self.top_p)
        self.top_k = _check_int("top_k", self.top_k)
        self.min_p = _check_float("min_p", self.min_p)
        self.repetition_penalty = _check_float("repetition_penalty", self.repetition_penalty)
        self.presence_penalty = _check_float("presence_penalty", self.presence_penalty)
        self.frequency_penalty = _check_float("frequency_penalty", self.frequency_penalty)
        self.max_tokens = _check_int("max_tokens", self.max_tokens, optional=True)
        self.min_tokens = _check_int("min_tokens", self.min_tokens)
        self.seed = _check_int("seed", self.seed, optional=True)
        self.logprobs = _check_int("logprobs", self.logprobs, optional=True)
        self.prompt_logprobs = _check_int("prompt_logprobs", self.prompt_logprobs, optional=True)
        self.ignore_eos = _check_bool("ignore_eos", self.ignore_eos)
        self.skip_special_tokens = _check_bool("skip_special_tokens", self.skip_special_tokens)
        self.spaces_between_special_tokens = _check_bool(
            "spaces_between_special_tokens", self.spaces_between_special_tokens
        )
        self.include_stop_str_in_output = _check_bool(
            "include_stop_str_in_output", self.include_stop_str_in_output
        )
        self.logit_bias = self._normalise_logit_bias(self.logit_bias)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict or None, got {type(self.extra_args).__name__}")
        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_token_ids(self.stop_token_ids)
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, a dict or None")

        # --- ranges ---
        if self.top_k == -1:
            self.top_k = 0
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature:g}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p:g}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be 0 or -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p:g}")
        if self.repetition_penalty <= 0.0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty:g}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty:g}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty:g}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1 or None, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be <= max_tokens={self.max_tokens}, got {self.min_tokens}"
            )
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise ValueError(f"logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.logprobs}")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}] or None, got {self.prompt_logprobs}")

    @staticmethod
    def _normalise_logit_bias(bias: Any) -> dict[int, float] | None:
        if bias is None or bias == {}:
            return None
        if not isinstance(bias, dict):
            raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(bias).__name__}")
        out: dict[int, float] = {}
        for k, v in bias.items():
            try:
                tid = int(k) if isinstance(k, str) else _check_int("logit_bias", k)
            except ValueError:
                raise ValueError(f"logit_bias keys must be token ids (ints), got {k!r}") from None
            if tid is None or not 0 <= tid <= INT64_MAX:
                raise ValueError(f"logit_bias keys must be token ids >= 0, got {k!r}")
            b = _check_float("logit_bias", v)
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {v!r} for token {tid}")
            out[tid] = b
        return out

    @staticmethod
    def _normalise_stop(stop: Any) -> list[str]:
        if stop is None:
            return []
        items = [stop] if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise ValueError(f"stop must be a str, a list of str or None, got {stop!r}")
        for s in items:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only str, got {s!r} ({type(s).__name__})")
            if not s:
                raise ValueError("stop strings must be non-empty, got ''")
        return list(items)

    @staticmethod
    def _normalise_stop_token_ids(ids: Any) -> list[int]:
        if ids is None:
            return []
        if not isinstance(ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of int or None, got {ids!r}")
        result: list[int] = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise ValueError(
                    f"stop_token_ids must contain only int, got {t!r} ({type(t).__name__})"
                )
            if not 0 <= t <= INT64_MAX:
                raise ValueError(f"stop_token_ids must be in [0, 2**63 - 1], got {t}")
            result.append(int(t))
        return result

    @property
    def is_greedy(self) -> bool:
        """True when decoding is deterministic argmax (temperature < ``SAMPLING_EPS``)."""
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    def clone(self) -> SamplingParams:
        """A deep copy (the list fields are not shared with the original)."""
        return copy.deepcopy(self)
