"""Structured outputs and tool calling through the real server: a ``tinyvllm serve`` process with the
real SmolLM2-135M-Instruct, driven by the official ``openai`` client; outputs are checked with
``jsonschema`` against the schema asked for.

The session's shared server (tests/conftest.py ``shared_server``; greedy decoding unless a test says otherwise).
"""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

MODEL = "SmolLM2-135M-Instruct"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
SEARCH = {"type": "function", "function": {
    "name": "search_web", "description": "Search the web",
    "parameters": {"type": "object", "properties": {
        "query": {"type": "string", "maxLength": 40},
        "max_results": {"type": "integer", "minimum": 1, "maximum": 10}},
        "required": ["query", "max_results"], "additionalProperties": False}}}
TOOLS = [WEATHER, SEARCH]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # the session's (tests/conftest.py): its flags include the Hermes tool-call parser


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=300)


# ----------------------------------------------------------------------------- response_format


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: int = Field(ge=0, le=100)
    kind: Literal["capital", "town", "village"]


def test_parse_with_pydantic_model(client):
    completion = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        temperature=0, max_completion_tokens=120)
    msg = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(msg.parsed, City)
    jsonschema.validate(json.loads(msg.content), City.model_json_schema())


def test_json_object(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object about a cat."}],
        response_format={"type": "json_object"}, temperature=0, max_completion_tokens=80)
    ch = r.choices[0]
    if ch.finish_reason == "stop":
        assert isinstance(json.loads(ch.message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert ch.finish_reason == "length" and ch.message.content.startswith("{")


def test_structured_outputs_extension_both_endpoints(client):
    r = client.completions.create(model=MODEL, prompt="My favourite colour is", max_tokens=10, temperature=0,
                                  extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].text in ("red", "green", "blue") and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me an email address."}], temperature=0,
        max_completion_tokens=40, extra_body={"structured_outputs": {"regex": r"[a-z]{1,10}@[a-z]{1,10}\.com"}})
    assert re.fullmatch(r"[a-z]{1,10}@[a-z]{1,10}\.com", r.choices[0].message.content)
    r = client.completions.create(model=MODEL, prompt="Answer yes or no: is the sky blue?", max_tokens=5,
                                  temperature=0,
                                  extra_body={"structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert r.choices[0].text in ("yes", "no")


def test_unsatisfiable_within_max_tokens_finishes_with_length(client):
    r = client.completions.create(model=MODEL, prompt="Count:", max_tokens=5, temperature=0,
                                  extra_body={"structured_outputs": {"regex": "a{50}"}})
    assert r.choices[0].finish_reason == "length"
    assert set(r.choices[0].text) <= {"a"}


def test_n_samples_each_follow_the_grammar(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Pick a number."}], n=3, temperature=1.0, seed=7,
        max_completion_tokens=10, extra_body={"structured_outputs": {"regex": "[1-9][0-9]?"}})
    assert len(r.choices) == 3
    for ch in r.choices:
        assert ch.message.content.isdigit() and 1 <= int(ch.message.content) <= 99


def test_stop_string_and_logprobs_with_a_grammar(client):
    r = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Spell a word."}], temperature=0,
        max_completion_tokens=20, logprobs=True, top_logprobs=3, stop=["c"],
        extra_body={"structured_outputs": {"regex": "abcabc"}})
    ch = r.choices[0]
    assert ch.message.content == "ab" and ch.finish_reason == "stop"
    # Logprobs are those of the masked distribution: every listed alternative is a token the grammar
    # allowed there (a prefix of "abcabc"), never one the raw distribution preferred.
    so_far = ""
    for entry in ch.logprobs.content:
        assert entry.top_logprobs and all("abcabc".startswith(so_far + t.token) or t.logprob <= -9999
                                          for t in entry.top_logprobs)
        so_far += entry.token


# ----------------------------------------------------------------------------- tools


def _check_calls(calls, allowed: dict[str, dict]):
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), allowed[call.function.name])


def test_tool_choice_required(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_completion_tokens=100)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    _check_calls(ch.message.tool_calls, SCHEMAS)


MARKUP = ("<tool_call>", "</tool_call>", "<tool", "</tool", "tool_call", '{"name"')


def _chat(client, stream: bool, **kw) -> tuple[str | None, list[tuple[str, str]], str, list[str]]:
    """``(content, [(name, arguments)], finish_reason, content deltas)`` of one chat completion, streamed
    (the deltas put together as a client does) or not."""
    if not stream:
        ch = client.chat.completions.create(model=MODEL, **kw).choices[0]
        calls = [(t.function.name, t.function.arguments) for t in ch.message.tool_calls or []]
        return ch.message.content, calls, ch.finish_reason, []
    deltas, calls, finish = [], {}, None
    for chunk in client.chat.completions.create(model=MODEL, stream=True, **kw):
        for ch in chunk.choices:
            if ch.delta.content:
                deltas.append(ch.delta.content)
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, ["", ""])
                c[0] += (tc.function.name or "") if tc.function else ""
                c[1] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return "".join(deltas) or None, [tuple(c) for c in calls.values()], finish, deltas


def _no_markup(content, deltas):
    for text in [content or ""] + deltas:
        assert not any(m in text for m in MARKUP), repr(text)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_parallel_tool_calls_cut_by_max_tokens(client, stream):
    # Issue 41: the small model keeps calling tools until max_tokens. Every complete call validates and
    # is returned; the call cut by the limit is dropped, never left in the content (nor streamed as
    # delta.content), and finish_reason stays "length".
    content, calls, finish, deltas = _chat(client, stream, messages=ASK, tools=TOOLS, tool_choice="required",
                                           temperature=0, max_completion_tokens=60)
    assert finish == "length" and len(calls) >= 1
    for name, args in calls:
        jsonschema.validate(json.loads(args), SCHEMAS[name])
    assert not content and not deltas
    _no_markup(content, deltas)


TREE = {"type": "function", "function": {
    "name": "make_tree", "description": "Build a tree of named nodes",
    "parameters": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 20},
        "children": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["name", "children"], "additionalProperties": False}}}


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
@pytest.mark.parametrize("tools,max_tokens", [(TOOLS, 12), ([TREE], 40)], ids=["first-call-cut", "recursive"])
def test_call_cut_before_its_end_leaves_no_markup(client, stream, tools, max_tokens):
    # Issue 41: cut inside the first call (and a recursive schema that nests until the limit): no call,
    # no content, finish_reason "length"; not a byte of the call syntax in content or any delta.
    content, calls, finish, deltas = _chat(client, stream, messages=ASK, tools=tools, tool_choice="required",
                                           temperature=0, max_completion_tokens=max_tokens)
    assert finish == "length" and calls == [] and not content and not deltas
    _no_markup(content, deltas)


def test_cut_markup_dropped_by_the_parsers():
    # The rule at the parsers, for every way the cut can fall (within "<tool_call>", the JSON, between
    # calls), streamed in pieces of every size and not streamed: same calls, no markup.
    from tinyvllm.entrypoints.openai.tool_calls import HermesToolParser, StreamingToolCallParser
    one = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
    full = "Sure.\n" + one + "\n" + one
    for cut in range(len(full) + 1):
        text = full[:cut]
        want = text.count("</tool_call>")
        content, calls = HermesToolParser().extract(text)
        content = (content or "").strip()
        assert len(calls) == want and "Sure.".startswith(content), (cut, content)
        _no_markup(content, [])
        for step in (1, 2, 5, 13):
            p, out, n = StreamingToolCallParser(), "", 0
            pieces = [text[k:k + step] for k in range(0, len(text), step)] or [""]
            for k, piece in enumerate(pieces):
                c, chunks = p.feed(piece, final=k == len(pieces) - 1)
                out += c
                n += len(chunks)
            assert n == 2 * want and out.strip() == content, (cut, step, out)
            _no_markup(out, [])


@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_parallel_tool_calls_false_stops_after_one_call(client, stream):
    # Issue 41: where parallel calls go on (get_weather, search_web, get_weather... until max_tokens in
    # the test above), parallel_tool_calls=false makes the grammar end the output after the first call.
    content, calls, finish, deltas = _chat(client, stream, messages=ASK, tools=TOOLS, tool_choice="required",
                                           parallel_tool_calls=False, temperature=0, max_completion_tokens=200)
    assert finish == "tool_calls" and len(calls) == 1 and not content and not deltas
    jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[calls[0][0]])


def test_tool_choice_named(client):
    r = client.chat.completions.create(
        model=MODEL, messages=ASK, tools=TOOLS, temperature=0, max_completion_tokens=100,
        tool_choice={"type": "function", "function": {"name": "search_web"}})
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and len(ch.message.tool_calls) == 1
    _check_calls(ch.message.tool_calls, {"search_web": SCHEMAS["search_web"]})


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}],
                         ids=["required", "named"])
def test_tool_calls_streamed(client, choice):
    stream = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                            parallel_tool_calls=False, temperature=0, max_completion_tokens=100,
                                            stream=True)
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for ch in chunk.choices:
            for tc in ch.delta.tool_calls or []:
                c = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                c["id"] = c["id"] or tc.id
                if tc.function and tc.function.name:
                    c["name"] += tc.function.name
                if tc.function and tc.function.arguments:
                    c["arguments"] += tc.function.arguments
            finish = ch.finish_reason or finish
    assert finish == "tool_calls" and calls
    for c in calls.values():
        assert c["id"].startswith("call_") and c["name"] in SCHEMAS
        jsonschema.validate(json.loads(c["arguments"]), SCHEMAS[c["name"]])
    # The same call as without streaming (greedy): same name and arguments.
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice=choice,
                                       parallel_tool_calls=False, temperature=0, max_completion_tokens=100)
    assert [(t.function.name, t.function.arguments) for t in r.choices[0].message.tool_calls] == \
        [(c["name"], c["arguments"]) for c in calls.values()]


def test_tool_choice_auto_gives_text_or_a_valid_call(client):
    for messages in (ASK, [{"role": "user", "content": "Say hello."}]):
        r = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS, tool_choice="auto",
                                           temperature=0, max_completion_tokens=30)
        ch = r.choices[0]
        if ch.message.tool_calls:
            assert ch.finish_reason == "tool_calls"
            _check_calls(ch.message.tool_calls, SCHEMAS)
        else:
            assert ch.finish_reason in ("stop", "length")
            assert not any(m in (ch.message.content or "") for m in ("<tool_call>", "</tool_call>", "<tool_"))


def test_tool_history_round_trip(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER], tool_choice="required",
                                       parallel_tool_calls=False, temperature=0, max_completion_tokens=100)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump(exclude_none=True)]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    r2 = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER], tool_choice="none",
                                        temperature=0, max_completion_tokens=12)
    assert r2.choices[0].message.content and not r2.choices[0].message.tool_calls


# ----------------------------------------------------------------------------- errors


def _post(server, path, body):
    return httpx.post(server.base + path, json={"model": MODEL, **body}, timeout=120)


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "object", "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["b"]}}}}},
     "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),
    ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "nonsense"}}}}}], "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
], ids=["invalid-schema", "unsupported-keyword", "bad-response-format", "bad-regex", "bad-grammar",
        "empty-choice", "two-constraints", "unknown-tool-name", "bad-tool-choice", "tool-params-not-object",
        "tool-params-invalid-schema", "tool-without-function"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "sse"])
def test_invalid_constraints_are_400_naming_the_field(server, body, param, stream):
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, "stream": stream, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"]


def test_invalid_constraint_on_completions_is_400(server):
    r = _post(server, "/v1/completions", {"prompt": "x", "structured_outputs": {"json": {"type": "objectx"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "structured_outputs"


def test_server_still_serves_after_errors(client, server):
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length"
    m = httpx.get(server.base + "/metrics", timeout=10).text
    running = [ln for ln in m.splitlines() if ln.startswith("tinyvllm:num_requests_running")]
    assert running and all(float(ln.split()[-1]) == 0 for ln in running)


# ----------------------------------------------------------------------------- bench serve

def test_bench_serve_agent_answers_are_constrained_tool_calls(server):
    """``bench serve --dataset agent --agent-tool-calls`` against the real server: every turn's answer is a
    grammar-constrained JSON tool call, and each one parses and follows the schema."""
    import asyncio

    from tinyvllm.benchmarks import datasets as ds
    from tinyvllm.benchmarks.serve import run_benchmark

    # Room for a degenerate query: with float32 logits (issue 37) one turn writes "sauce_flea_flea..." to
    # the 40-character limit in 68 tokens, where the same text elsewhere takes 49 (some tokens of that
    # run show no text: noted in issue 37's closing note); at 48 and 64 it was cut by max_tokens.
    wl = ds.agent_dataset(2, 2, prefix_len=60, user_len=8, output_len=128, tool_result_len=20, think_time=0.0)
    res = asyncio.run(run_benchmark(server.base, MODEL, wl, agent_tool_calls=True))  # ignore_eos too
    assert res["completed"] == 4 and res["errors"] == 0
    assert res["tool_calls"] == {"answered": 4, "valid": 4}
    for r in res["requests"]:
        call = json.loads(r["generated_text"])
        assert call["name"] in ds.AGENT_TOOL_NAMES and r["output_tokens"] < 128  # ended by the grammar


# ----------------------------------------------------------------------------- schemas the grammar cannot enforce

ISSUE41 = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["b"], "additionalProperties": False}


@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": ISSUE41}}}, "response_format"),
    ({"structured_outputs": {"json": ISSUE41}}, "structured_outputs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ISSUE41}}], "tool_choice": "required"},
     "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": ISSUE41}}],
      "tool_choice": {"type": "function", "function": {"name": "f"}}}, "tools"),
], ids=["response_format", "structured_outputs", "tool-required", "tool-named"])
def test_required_name_not_in_properties_is_400_naming_required(server, body, param):
    """Issue 41: no value satisfies this schema (``b`` is required, only ``a`` may appear); it was accepted
    and answered ``{"a": 123}``. Now a 400 naming the field and the keyword."""
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 20, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400
    assert "/required" in err["message"] and "'b'" in err["message"]


@pytest.mark.parametrize("schema,keyword", [
    ({"allOf": [{"type": "integer"}, {"type": "string"}]}, "allOf"),
    ({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "oneOf"),
    ({"type": "string", "const": 1}, "const"),
    ({"type": "string", "minLength": 2, "enum": ["a", "bb"]}, "enum"),
    ({"type": "string", "pattern": "^a+$", "minLength": 3}, "pattern"),
    ({"type": "number", "multipleOf": 0.5}, "multipleOf"),
    ({"type": "integer", "minimum": 0, "multipleOf": 2}, "multipleOf"),
    ({"type": "object", "additionalProperties": True, "minProperties": 2}, "minProperties"),
    ({"$ref": "#/$defs/n", "minimum": 3, "$defs": {"n": {"type": "integer"}}}, "$ref"),
    ({"minLength": 2}, "minLength"),
    ({"anyOf": []}, "anyOf"),
    ({"type": []}, "type"),
    ({"$schema": 5, "type": "integer"}, "$schema"),  # was a 500 in the check's first version
    ({"type": "object", "const": {"a": 1}, "properties": {"a": {"$ref": "#/nowhere"}}}, "const"),  # ditto
], ids=lambda v: v if isinstance(v, str) else None)
def test_unenforceable_schema_is_400_naming_the_keyword(server, schema, keyword):
    """Each of these compiled in xgrammar 0.2.9, and the grammar let through a value the schema rejects."""
    r = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 20, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "response_format" and f"/{keyword}" in err["message"], err
