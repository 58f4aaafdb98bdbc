"""Synthetic benchmark workloads, generated deterministically from a seed.

Nothing is downloaded. The client usually does not have the server's
tokenizer, so prompts are built in one of two formats:

* ``text`` (default): words drawn from a fixed list of common English words,
  each written with a leading space. For BPE tokenizers of the Llama/GPT family
  one such word is (almost always) one token, so a prompt of ``n`` words is
  about ``n`` tokens. The exact count is whatever the server reports in
  ``usage.prompt_tokens``, and that is what the benchmark reports.
* ``token-ids``: lists of integer token ids drawn from ``[1000, vocab_size)``;
  ``/v1/completions`` accepts a list of ints as ``prompt`` (vLLM, tinyvllm).
  Exact lengths, but only for the completions endpoint.

Workloads:

* ``random``: independent prompts of ``input_len`` tokens asking for
  ``output_len`` tokens; with ``range_ratio`` r both lengths are drawn
  uniformly from ``[L*(1-r), L*(1+r)]``.
* ``shared-prefix``: ``num_groups`` groups; every prompt of a group starts with
  the group's long prefix (system prompt + tool definitions, ``prefix_len``
  tokens) followed by a short distinct suffix (``suffix_len`` tokens).
* ``agent``: ``sessions`` multi-turn sessions of ``turns`` turns each. The
  history is built at run time (it contains the model's real answers), so the
  dataset only holds each session's static parts: the shared system prompt and
  tool definitions, one user message per turn and one tool result per turn.
  The agent workload is always text (the model's answer is text and must be
  appended to the history).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence, Union

Prompt = Union[str, list[int]]

# Common English words that are single tokens (with a leading space) in the
# usual BPE vocabularies (GPT-2/Llama/SmolLM families).
WORDS: tuple[str, ...] = tuple(
    """
    the of and to in is was for on that with as by at from his her he she it
    they we you are be this have not but had all were when there can an which
    their said if do will each about how up out them then many some so these
    would other into has more two like him see time could no make than first
    been its who now people my made over did down only way find use may water
    long little very after words called just where most know get through back
    much before go good new write our used me man too any day same right look
    think also around another came come work three word must because does part
    even place well such here take why things help put years different away
    again off went old number great tell men say small every found still
    between name should home big give air line set own under read last never
    us left end along while might next sound below saw something thought both
    few those always looked show large often together asked house world going
    want school important until form food keep children feet land side without
    boy once animals life enough took sometimes four head above kind began
    almost live page got earth need far hand high year mother light parts
    country father let night following picture being study second eyes soon
    times story boys since white days ever paper hard near sentence better best
    across during today others however sure means knew try told young miles sun
    ways thing whole hear example heard several change answer room sea against
    top turned learn point city play toward five using himself usually money
    seen car morning table river order open list step data file search return
    value state result call query source index model token cache block memory
    """.split()
)

# Structural words used around sections (also single tokens).
_SYSTEM_HEADER = "System:"
_TOOLS_HEADER = "Tools:"


@dataclass
class RequestSpec:
    """One request of a flat (non-agent) workload."""

    prompt: Prompt
    max_tokens: int
    prompt_len: int  # nominal prompt length in tokens (words for text)
    session_id: int | None = None
    turn: int | None = None
    group_id: int | None = None


@dataclass
class AgentSession:
    """Static parts of one agent session; the history is built at run time.

    Turn k sends ``prefix + sum_{j<k}(user_j + answer_j + tool_result_j) + user_k``
    where ``answer_j`` is the model's actual returned text.
    """

    session_id: int
    prefix: str  # system prompt + tool definitions
    user_messages: list[str]
    tool_results: list[str]
    max_tokens: int  # length of the model's "tool call" answer

    @property
    def num_turns(self) -> int:
        return len(self.user_messages)

    def user_block(self, turn: int) -> str:
        return f"\nUser:{self.user_messages[turn]}\nAssistant:"

    def tool_block(self, turn: int) -> str:
        return f"\nTool:{self.tool_results[turn]}"


@dataclass
class AgentWorkload:
    sessions: list[AgentSession]
    think_time: float = 1.0
    meta: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(s.num_turns for s in self.sessions)


# ---------------------------------------------------------------- helpers


def _words(rng: random.Random, n: int) -> str:
    """``n`` random words, each with a leading space (so ~n tokens)."""
    return "".join(" " + rng.choice(WORDS) for _ in range(max(0, n)))


def _token_ids(rng: random.Random, n: int, vocab_size: int) -> list[int]:
    lo = min(1000, max(0, vocab_size // 2))
    return [rng.randrange(lo, vocab_size) for _ in range(max(0, n))]


def _draw_len(rng: random.Random, length: int, range_ratio: float) -> int:
    if range_ratio <= 0:
        return max(1, int(length))
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return rng.randint(lo, hi)


def _check_format(prompt_format: str) -> None:
    if prompt_format not in ("text", "token-ids"):
        raise ValueError(f"prompt_format must be 'text' or 'token-ids', got {prompt_format!r}")


def _prefix_text(rng: random.Random, prefix_len: int) -> str:
    """System prompt + tool definitions, about ``prefix_len`` tokens."""
    body = max(0, prefix_len - 2)  # two header words
    n_sys = body // 4
    n_tools = body - n_sys
    return f"{_SYSTEM_HEADER}{_words(rng, n_sys)}\n{_TOOLS_HEADER}{_words(rng, n_tools)}\n"


# ---------------------------------------------------------------- workloads


def random_dataset(
    num_prompts: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    seed: int = 0,
    prompt_format: str = "text",
    vocab_size: int = 32000,
) -> list[RequestSpec]:
    _check_format(prompt_format)
    if not 0 <= range_ratio < 1:
        raise ValueError("range_ratio must be in [0, 1)")
    rng = random.Random(f"random:{seed}")
    out: list[RequestSpec] = []
    for _ in range(num_prompts):
        n_in = _draw_len(rng, input_len, range_ratio)
        n_out = _draw_len(rng, output_len, range_ratio)
        prompt: Prompt = (
            _token_ids(rng, n_in, vocab_size) if prompt_format == "token-ids" else _words(rng, n_in)
        )
        out.append(RequestSpec(prompt=prompt, max_tokens=n_out, prompt_len=n_in))
    return out


def shared_prefix_dataset(
    num_prompts: int,
    num_groups: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    seed: int = 0,
    prompt_format: str = "text",
    vocab_size: int = 32000,
) -> list[RequestSpec]:
    """Prompts assigned to groups round-robin, then shuffled (seeded)."""
    _check_format(prompt_format)
    if num_groups < 1:
        raise ValueError("num_groups must be >= 1")
    rng = random.Random(f"shared-prefix:{seed}")
    prefixes: list[Prompt] = []
    for _ in range(num_groups):
        if prompt_format == "token-ids":
            prefixes.append(_token_ids(rng, prefix_len, vocab_size))
        else:
            prefixes.append(_prefix_text(rng, prefix_len))
    out: list[RequestSpec] = []
    for i in range(num_prompts):
        g = i % num_groups
        if prompt_format == "token-ids":
            prompt: Prompt = list(prefixes[g]) + _token_ids(rng, suffix_len, vocab_size)
        else:
            prompt = f"{prefixes[g]}User:{_words(rng, max(0, suffix_len - 1))}"
        out.append(
            RequestSpec(
                prompt=prompt, max_tokens=output_len, prompt_len=prefix_len + suffix_len, group_id=g
            )
        )
    rng.shuffle(out)
    return out


def agent_dataset(
    sessions: int,
    turns: int,
    prefix_len: int = 1000,
    user_len: int = 30,
    output_len: int = 30,
    tool_result_len: int = 300,
    think_time: float = 1.0,
    seed: int = 0,
) -> AgentWorkload:
    """All sessions share one system prompt + tool definitions (same agent app)."""
    if sessions < 1 or turns < 1:
        raise ValueError("sessions and turns must be >= 1")
    rng = random.Random(f"agent:{seed}")
    prefix = _prefix_text(rng, prefix_len)
    out = []
    for s in range(sessions):
        users = [_words(rng, user_len) for _ in range(turns)]
        tools = [_words(rng, tool_result_len) for _ in range(turns)]
        out.append(
            AgentSession(
                session_id=s, prefix=prefix, user_messages=users, tool_results=tools, max_tokens=output_len
            )
        )
    meta = dict(
        sessions=sessions,
        turns=turns,
        prefix_len=prefix_len,
        user_len=user_len,
        output_len=output_len,
        tool_result_len=tool_result_len,
        think_time=think_time,
    )
    return AgentWorkload(sessions=out, think_time=think_time, meta=meta)


# ---------------------------------------------------------------- agent tool calls

AGENT_TOOL_NAMES = ("search_files", "read_file", "run_tests", "edit_file")


def tool_call_schema(names: Sequence[str] = AGENT_TOOL_NAMES, max_arg_len: int = 40) -> dict:
    """JSON schema of one agent tool call, ``{"name": <one of names>, "arguments": {"query": str}}``:
    the constraint of ``bench serve --agent-tool-calls`` (sent as ``structured_outputs.json``)."""
    return {
        "type": "object",
        "properties": {
            "name": {"enum": list(names)},
            "arguments": {"type": "object", "properties": {"query": {"type": "string", "maxLength": max_arg_len}},
                          "required": ["query"], "additionalProperties": False},
        },
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def is_valid_tool_call(text: str, names: Sequence[str] = AGENT_TOOL_NAMES, max_arg_len: int = 40) -> bool:
    """Whether ``text`` is a JSON tool call that follows :func:`tool_call_schema` (checked by hand, so the
    client needs no schema library)."""
    import json

    try:
        obj = json.loads(text)
    except ValueError:
        return False
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"} or obj["name"] not in names:
        return False
    args = obj["arguments"]
    return (isinstance(args, dict) and set(args) == {"query"} and isinstance(args["query"], str)
            and len(args["query"]) <= max_arg_len)

