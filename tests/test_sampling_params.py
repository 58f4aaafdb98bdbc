"""Validation and normalisation of SamplingParams."""

from __future__ import annotations

import math
from typing import Any

import pytest

from tinyvllm.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    assert p.n == 1
    assert p.temperature == 1.0
    assert p.top_p == 1.0
    assert p.top_k == 0
    assert p.min_p == 0.0
    assert p.repetition_penalty == 1.0
    assert p.presence_penalty == 0.0
    assert p.frequency_penalty == 0.0
    assert p.max_tokens == 16
    assert p.min_tokens == 0
    assert p.seed is None
    assert p.stop == []
    assert p.stop_token_ids == []
    assert p.ignore_eos is False
    assert p.logprobs is None
    assert p.prompt_logprobs is None
    assert p.skip_special_tokens is True
    assert p.spaces_between_special_tokens is False
    assert p.include_stop_str_in_output is False
    assert not p.is_greedy
    assert p.sampling_type is SamplingType.RANDOM
    assert not p.has_penalties


def test_valid_edge_values_accepted() -> None:
    SamplingParams(
        n=3, temperature=0.0, top_p=1e-6, top_k=1, min_p=1.0, repetition_penalty=1e-3,
        presence_penalty=-2.0, frequency_penalty=2.0, max_tokens=1, min_tokens=1,
        seed=-7, logprobs=MAX_LOGPROBS, prompt_logprobs=0,
    )
    SamplingParams(max_tokens=None, min_tokens=10_000, logprobs=0, temperature=2)


def test_top_k_minus_one_normalised_to_zero() -> None:
    assert SamplingParams(top_k=-1).top_k == 0
    assert SamplingParams(top_k=5).top_k == 5


def test_stop_normalisation() -> None:
    assert SamplingParams(stop="\n").stop == ["\n"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop=None).stop == []
    assert SamplingParams(stop_token_ids=(2, 0)).stop_token_ids == [2, 0]
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []


def test_numeric_types_are_normalised() -> None:
    p = SamplingParams(temperature=1, top_p=1)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_greedy_and_seeded_types() -> None:
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=1e-4).is_greedy
    assert SamplingParams(temperature=0.0, seed=1).sampling_type is SamplingType.GREEDY
    assert SamplingParams(seed=1).sampling_type is SamplingType.RANDOM_SEED
    assert SamplingParams(presence_penalty=0.1).has_penalties


def test_clone_is_deep_and_equal() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[3], seed=4, temperature=0.7)
    q = p.clone()
    assert q == p and q is not p
    q.stop.append("y")
    q.stop_token_ids.append(5)
    assert p.stop == ["x"] and p.stop_token_ids == [3]


INVALID: list[tuple[str, Any]] = [
    ("n", 0), ("n", -1), ("n", 1.5), ("n", "2"), ("n", True), ("n", None),
    ("temperature", -1), ("temperature", -1e-9), ("temperature", math.inf),
    ("temperature", math.nan), ("temperature", "hot"), ("temperature", None), ("temperature", True),
    ("top_p", 0.0), ("top_p", 1.0001), ("top_p", -0.5), ("top_p", math.nan), ("top_p", "1"),
    ("top_k", -2), ("top_k", 2.5), ("top_k", "5"), ("top_k", None),
    ("min_p", -0.1), ("min_p", 1.1), ("min_p", math.nan), ("min_p", [0.1]),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("repetition_penalty", "x"),
    ("presence_penalty", 2.01), ("presence_penalty", -2.01), ("presence_penalty", "0"),
    ("frequency_penalty", 2.5), ("frequency_penalty", -3), ("frequency_penalty", math.nan),
    ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.0), ("max_tokens", "16"),
    ("min_tokens", -1), ("min_tokens", 0.5), ("min_tokens", None),
    ("seed", 1.5), ("seed", "42"),
    ("logprobs", -1), ("logprobs", MAX_LOGPROBS + 1), ("logprobs", 2.0), ("logprobs", True),
    ("prompt_logprobs", -1), ("prompt_logprobs", "3"),
    ("stop", ""), ("stop", ["ok", ""]), ("stop", [1]), ("stop", 5), ("stop", b"x"),
    ("stop_token_ids", [-1]), ("stop_token_ids", [1.0]), ("stop_token_ids", ["2"]),
    ("stop_token_ids", 3), ("stop_token_ids", [True]),
    ("ignore_eos", 1), ("skip_special_tokens", "yes"),
    ("spaces_between_special_tokens", None), ("include_stop_str_in_output", 0),
]


@pytest.mark.parametrize(("field", "value"), INVALID, ids=[f"{f}={v!r}" for f, v in INVALID])
def test_invalid_value_raises_naming_field(field: str, value: Any) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    assert field in message, message


def test_message_format() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_min_tokens_above_max_tokens_rejected() -> None:
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    SamplingParams(max_tokens=5, min_tokens=5)
