"""OpenAI's Responses API (``/v1/responses``) through the real server: a ``tinyvllm serve`` process with the
real SmolLM2-135M-Instruct, driven by the official ``openai`` SDK (``responses.create`` / ``responses.stream``)
and by the ``openai-agents`` package (its ``OpenAIResponsesModel``). The endpoint is a translation layer onto the
chat path, so the reference for what it generates is ``/v1/chat/completions`` on the same conversation (greedy:
the same tokens); the protocol (event order, ``sequence_number``, items, usage, status, errors) is checked
against the SDK's own types. Plus the store: ``previous_response_id`` chains on warm KV, GET / DELETE / 404,
isolation by API key, the count / bytes / idle-time bounds (the store class directly, and over HTTP).

The session's keyed server (tests/conftest.py ``keyed_server``: two API keys, a store bounded to a few responses),
which test_messages_api's ``--api-key`` test also uses; every generation is short.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import sqlite3
import time

import httpx
import jsonschema
import openai
import pytest

from server_utils import KEYED_MAX_STORED, KEYED_SERVER_KEYS, MODEL, Server
from tinyvllm.entrypoints.openai.responses_store import ResponseStore, owner_of

KEY_A, KEY_B = KEYED_SERVER_KEYS
MAX_STORED = KEYED_MAX_STORED

BLOCK_SIZE = 16  # the engine's default --block-size
WEATHER = {"type": "function", "name": "get_weather", "description": "Current weather in a city",
           "parameters": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
T0 = {"temperature": 0}


@pytest.fixture(scope="module")
def store_path(server):
    return server.store_path


@pytest.fixture(scope="module")
def server(keyed_server):
    """The session's keyed server (tests/conftest.py): the shared server's flags, keys A and B, a store of at most
    MAX_STORED responses, --reasoning-parser qwen3 (SmolLM2 never writes <think> by itself; the reasoning test
    forces a thought with a regex)."""
    return keyed_server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base + "/v1", api_key=KEY_A, max_retries=0, timeout=120)


def _chat(server, messages, **kw) -> dict:
    r = httpx.post(server.base + "/v1/chat/completions", headers=server.headers, timeout=120,
                   json={"model": MODEL, "messages": messages, **kw})
    assert r.status_code == 200, r.text
    return r.json()


# ----------------------------------------------------------------------------- text


def test_create_text_matches_chat(client, server):
    r = client.responses.create(model=MODEL, instructions="You are terse.", input="Say hello in one sentence.",
                                max_output_tokens=12, **T0)
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status in ("completed", "incomplete")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    assert [o.type for o in r.output] == ["message"] and r.output[0].content[0].type == "output_text"
    ref = _chat(server, [{"role": "system", "content": "You are terse."},
                         {"role": "user", "content": "Say hello in one sentence."}], max_tokens=12, **T0)
    # the same conversation through the chat path: the same prompt tokens and (greedy) the same text
    assert r.output_text == ref["choices"][0]["message"]["content"]
    assert r.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert r.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.input_tokens_details.cached_tokens >= 0 and r.usage.output_tokens_details.reasoning_tokens == 0
    assert (r.status == "incomplete") == (ref["choices"][0]["finish_reason"] == "length")


def test_stream_events_and_final_response(client):
    kw = dict(model=MODEL, input=[{"role": "user", "content": [{"type": "input_text", "text": "Name a color."}]}],
              max_output_tokens=10, **T0)
    full = client.responses.create(**kw)
    types, seqs, deltas = [], [], []
    with client.responses.stream(**kw) as s:
        for ev in s:
            types.append(ev.type)
            seqs.append(ev.sequence_number)
            if ev.type == "response.output_text.delta":
                deltas.append(ev.delta)
            last = ev
    assert seqs == list(range(len(seqs)))  # every event numbered, in order, from 0
    end = "response.completed" if full.status == "completed" else "response.incomplete"
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          end]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    assert "".join(deltas) == full.output_text
    final = last.response  # the terminal event's response (get_final_response() wants response.completed)
    assert final.output_text == full.output_text and final.status == full.status
    assert final.usage.output_tokens == full.usage.output_tokens and final.id != full.id


# ----------------------------------------------------------------------------- tools and formats


@pytest.mark.parametrize("stream", [pytest.param(False, marks=pytest.mark.slow), True], ids=["json", "stream"])
def test_function_tool_required(client, stream):
    # non-streamed calls are also made by the openai-agents test (default tier)
    kw = dict(model=MODEL, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
              parallel_tool_calls=False, max_output_tokens=64, **T0)
    if stream:
        with client.responses.stream(**kw) as s:
            types = [ev.type for ev in s]
            r = s.get_final_response()
        assert {"response.function_call_arguments.delta", "response.function_call_arguments.done"} <= set(types)
        assert "response.output_text.delta" not in types
    else:
        r = client.responses.create(**kw)
    assert r.status == "completed"
    calls = [o for o in r.output if o.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 150}},
              "required": ["name", "age"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Invent a person.", max_output_tokens=48,
                                text={"format": {"type": "json_schema", "name": "person", "schema": schema,
                                                 "strict": True}}, **T0)
    assert r.status == "completed", r
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"


def test_reasoning_item_whole_and_streamed(client):
    """With a --reasoning-parser, the model's thought is a reasoning item before the message (the thought is
    forced by a regex: SmolLM2 does not think by itself), whole and streamed alike."""
    kw = dict(model=MODEL, input="Is Paris in France?", max_output_tokens=40, extra_body={"structured_outputs": {
        "regex": r"<think>\n[A-Za-z ]{4,40}\.\n</think>\n\n(Yes|No)[a-z ,.]{0,20}"}}, **T0)
    r = client.responses.create(**kw)
    assert [o.type for o in r.output] == ["reasoning", "message"], r.output
    thought = r.output[0].content[0].text
    assert re.fullmatch(r"\n[A-Za-z ]{4,40}\.\n", thought) and re.fullmatch(r"(Yes|No)[a-z ,.]*", r.output_text)
    r_parts, t_parts, types = [], [], []
    with client.responses.stream(**kw) as s:
        for ev in s:
            types.append(ev.type)
            if ev.type == "response.reasoning_text.delta":
                r_parts.append(ev.delta)
            elif ev.type == "response.output_text.delta":
                t_parts.append(ev.delta)
    assert "".join(r_parts) == thought and "".join(t_parts) == r.output_text
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")


# ----------------------------------------------------------------------------- state


def test_previous_response_id_chain_of_5(client, server):
    """Five turns by previous_response_id: each turn's prompt is the stateless conversation's (as many tokens as
    the chat template renders for it; the last turn generates what chat completions does on the whole history),
    and all of the previous turn's prompt and output is served warm."""
    system = "You are a helpful assistant. Answer in at most one sentence. " * 3
    questions = ["Hi, my name is Ada.", "What is 2 + 2?", "Name a fruit.", "Name a planet.", "What is my name?"]
    history = [{"role": "system", "content": system}]
    prev = None
    for q in questions:
        r = client.responses.create(model=MODEL, instructions=system, input=q, max_output_tokens=8,
                                    previous_response_id=prev.id if prev else None, **T0)
        assert r.previous_response_id == (prev.id if prev else None)
        history.append({"role": "user", "content": q})
        t = httpx.post(server.base + "/tokenize", headers=server.headers, json={"model": MODEL, "messages": history})
        assert r.usage.input_tokens == t.json()["count"], t.text
        if prev is not None:  # the previous prompt + output (its KV: all but the last sampled token), in blocks
            warm = prev.usage.input_tokens + prev.usage.output_tokens - 1
            assert r.usage.input_tokens_details.cached_tokens >= warm // BLOCK_SIZE * BLOCK_SIZE, (r.usage, prev.usage)
        history.append({"role": "assistant", "content": r.output_text})
        prev = r
    ref = _chat(server, history[:-1], max_tokens=8, **T0)  # the last turn, stateless
    assert ref["usage"]["prompt_tokens"] == prev.usage.input_tokens
    assert ref["choices"][0]["message"]["content"] == prev.output_text


def test_get_delete_and_404(client):
    r = client.responses.create(model=MODEL, input="Say yes.", max_output_tokens=3, metadata={"k": "v"}, **T0)
    got = client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == r.output_text and got.metadata == {"k": "v"}
    assert got.usage.output_tokens == r.usage.output_tokens
    client.responses.delete(r.id)
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: client.responses.create(model=MODEL, input="x", previous_response_id=r.id)):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        err = e.value.body
        assert {"message", "type", "param", "code"} <= set(err) and err["code"] == 404, err
    assert e.value.body["param"] == "previous_response_id"
    # store: false keeps nothing
    r = client.responses.create(model=MODEL, input="Say yes.", max_output_tokens=2, store=False, **T0)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(r.id)


def test_api_key_isolation(client, server):
    r = client.responses.create(model=MODEL, input="Say yes.", max_output_tokens=2, **T0)
    other = openai.OpenAI(base_url=server.base + "/v1", api_key=KEY_B, max_retries=0, timeout=60)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="x", previous_response_id=r.id, max_output_tokens=1)
    assert client.responses.retrieve(r.id).id == r.id  # still there for its own key
    # the key itself is not stored, only its hash
    rows = sqlite3.connect(server_store(server)).execute("SELECT owner FROM responses WHERE id = ?",
                                                         (r.id,)).fetchall()
    assert rows == [(owner_of(KEY_A),)]


def server_store(server) -> str:
    """The server's store file (its --responses-store-path)."""
    return server.proc.args[server.proc.args.index("--responses-store-path") + 1]


def test_background_and_cancel(client, server):
    r = client.responses.create(model=MODEL, input="Count from 1 to 100.", max_output_tokens=300, background=True,
                                extra_body={"ignore_eos": True}, **T0)
    assert r.status == "in_progress" and r.background
    assert client.responses.retrieve(r.id).status in ("in_progress", "cancelled")
    c = client.responses.cancel(r.id)
    assert c.status == "cancelled"
    assert client.responses.retrieve(r.id).status == "cancelled"
    # a streaming response in progress: cancelled from another connection, its stream ends at once
    body = {"model": MODEL, "input": "Count from 1 to 100.", "max_output_tokens": 300, "ignore_eos": True,
            "stream": True, **T0}
    with httpx.stream("POST", server.base + "/v1/responses", json=body, headers=server.headers, timeout=60) as s:
        lines = s.iter_lines()
        first = json.loads(next(ln for ln in lines if ln.startswith("data: "))[6:])
        assert first["type"] == "response.created" and first["sequence_number"] == 0
        c = httpx.post(server.base + f"/v1/responses/{first['response']['id']}/cancel", headers=server.headers)
        assert c.status_code == 200 and c.json()["status"] == "cancelled", c.text
        events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: ")]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "cancelled"
    assert events[-1]["response"]["usage"]["output_tokens"] < 300
    assert not any(server.wait_idle().values()), server.state()  # the cancelled requests hold no KV block
    # a background response that runs to its end is stored as completed / incomplete
    r = client.responses.create(model=MODEL, input="Say yes.", max_output_tokens=3, background=True, **T0)
    deadline = time.monotonic() + 60
    while (got := client.responses.retrieve(r.id)).status == "in_progress" and time.monotonic() < deadline:
        time.sleep(0.1)
    assert got.status in ("completed", "incomplete") and got.usage.output_tokens >= 1
    with pytest.raises(openai.BadRequestError):  # only a response in progress can be cancelled
        client.responses.cancel(r.id)


def test_store_bounds_over_http(client, server):
    ids = [client.responses.create(model=MODEL, input=f"Say {i}.", max_output_tokens=1, **T0).id
           for i in range(MAX_STORED + 2)]
    rows = sqlite3.connect(server_store(server)).execute("SELECT COUNT(*) FROM responses").fetchone()[0]
    assert rows <= MAX_STORED
    for rid in ids[:2]:  # the least recently used went first
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(rid)
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


# ----------------------------------------------------------------------------- bad input


BAD = [
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools[0].type"),
    ({"tools": [{"type": "computer_use_preview", "display_width": 1, "display_height": 1,
                 "environment": "linux"}]}, "tools[0].type"),
    ({"tools": [{"type": "image_generation"}]}, "tools[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]},
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"type": "function_call_output", "call_id": "call_nope", "output": "1"}]}, "input"),
    ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": "16"}, "max_output_tokens"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"tool_choice": {"type": "function", "name": "nope"}, "tools": [WEATHER]}, "tool_choice"),
    ({"truncation": "auto"}, "truncation"),
    ({"conversation": "conv_1"}, "conversation"),
    ({"include": ["file_search_call.results"]}, "include[0]"),
    ({"temperature": -1}, "temperature"),
    ({"background": True, "store": False}, "background"),
    ({"stream": "true"}, "stream"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p for _, p in BAD])
def test_bad_input_is_400_naming_the_field(server, body, param):
    r = httpx.post(server.base + "/v1/responses", headers=server.headers, timeout=60,
                   json={"model": MODEL, "input": "hi", "max_output_tokens": 1, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["code"] == 400 and err["message"], err


def test_unknown_model_and_missing_key(server):
    r = httpx.post(server.base + "/v1/responses", headers=server.headers, json={"model": "nope", "input": "hi"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.get(server.base + "/v1/responses/resp_x")
    assert r.status_code == 401


# ----------------------------------------------------------------------------- openai-agents


def test_openai_agents_two_tools_three_turns(server):
    """The Agents SDK's Responses model against tinyvllm (no network, tracing off): a two-tool agent, three
    turns chained by previous_response_id; each turn forces one tool (the model's call must parse, the SDK runs
    the tool and sends its output back), then the model answers."""
    from agents import (Agent, ModelSettings, OpenAIResponsesModel, RunConfig, Runner, function_tool,
                        set_tracing_disabled)
    from agents.items import ToolCallItem, ToolCallOutputItem

    set_tracing_disabled(True)
    calls: list[tuple[str, str]] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(("get_weather", city))
        return f"It is sunny and 21 C in {city}."

    @function_tool
    def get_time(city: str) -> str:
        """The local time in a city."""
        calls.append(("get_time", city))
        return f"It is 14:05 in {city}."

    async def run() -> list:
        client = openai.AsyncOpenAI(base_url=server.base + "/v1", api_key=KEY_A, max_retries=0, timeout=120)
        model = OpenAIResponsesModel(model=MODEL, openai_client=client)
        results, prev = [], None
        for tool, question in [("get_weather", "What is the weather in Paris?"),
                               ("get_time", "What time is it in Tokyo?"), (None, "Thanks! Say goodbye.")]:
            agent = Agent(name="assistant", instructions="You are a helpful assistant. Use the tools.",
                          tools=[get_weather, get_time], model=model,
                          # an answer ends at its first sentence: the SDK raises on an incomplete response
                          model_settings=ModelSettings(temperature=0, max_tokens=48, extra_body={"stop": ["."]},
                                                       tool_choice=tool or "none"))
            res = await Runner.run(agent, question, previous_response_id=prev, max_turns=4,
                                   run_config=RunConfig(tracing_disabled=True))
            prev = res.last_response_id
            results.append(res)
        await client.close()
        return results

    results = asyncio.run(run())
    for res, tool in zip(results, ["get_weather", "get_time", None]):
        called = [i.raw_item.name for i in res.new_items if isinstance(i, ToolCallItem)]
        outputs = [i.output for i in res.new_items if isinstance(i, ToolCallOutputItem)]
        if tool is None:
            assert called == [] and outputs == []
        else:
            assert called[:1] == [tool] and outputs and outputs[0].startswith("It is")
        assert isinstance(res.final_output, str)
        assert res.last_response_id and res.last_response_id.startswith("resp_")
    assert [c[0] for c in calls][:1] == ["get_weather"] and "get_time" in [c[0] for c in calls]


# ----------------------------------------------------------------------------- the store itself


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _fill(store: ResponseStore, n: int, size: int, start: int = 0) -> None:
    payload = b"x" * size
    for i in range(start, start + n):
        store.put(f"resp_{i}", "", payload)


def test_store_bounds_hold_and_memory_is_flat(tmp_path):
    n = 10_000  # 0.1-0.4 ms per stored response (SQLite file, WAL)
    store = ResponseStore(tmp_path / "s.sqlite", max_count=500, max_bytes=2_000_000, ttl_s=3600)
    _fill(store, 200, 4000)
    rss0 = _rss()
    _fill(store, n, 4000, start=200)
    count, nbytes = store.stats()  # counted by SQLite
    assert (count, nbytes) == (store._count, store._bytes)  # the running totals the bounds are checked on
    assert count <= 500 and nbytes <= 2_000_000  # the byte bound binds first here (500 x 4000 > 2e6)
    assert count == 2_000_000 // 4000
    assert store.get(f"resp_{n + 199}", "") is not None and store.get("resp_0", "") is None
    assert store.evicted == n + 200 - count
    # n x 4 KB went through it; memory stays that of SQLite's page cache
    assert _rss() - rss0 < 16 << 20, (_rss() - rss0)
    store.close()


def test_store_lru_ttl_and_owner(tmp_path):
    now = [1000.0]
    store = ResponseStore(tmp_path / "s.sqlite", max_count=3, max_bytes=10_000, ttl_s=60, clock=lambda: now[0])
    for i in range(3):
        now[0] += 1
        store.put(f"r{i}", "a", b"x")
    now[0] += 1
    assert store.get("r0", "a") == b"x"  # r0 is now the most recently used
    store.put("r3", "a", b"x")  # evicts r1, the least recently used
    assert store.get("r1", "a") is None and store.get("r0", "a") is not None
    assert store.get("r0", "b") is None and not store.delete("r0", "b")  # another owner sees nothing
    now[0] += 61  # idle past the TTL: expired
    assert store.get("r2", "a") is None and store.expired >= 1
    assert not store.put("big", "a", b"x" * 10_001)  # larger than max_bytes alone: not stored
    store.close()
    # a reopened file keeps what was stored (a restart)
    store = ResponseStore(tmp_path / "s.sqlite", max_count=3, max_bytes=10_000, ttl_s=1e12)
    assert store.get("r0", "a") == b"x"
    store.close()


@pytest.mark.slow
def test_chain_resumed_after_restart_is_served_from_the_disk_tier(tmp_path):
    """A stored conversation survives a restart (the SQLite store) and its continuation's prompt is served by the
    disk KV offload tier (--kv-offload-path): turn 1, SIGKILL, start a new server on the same files, turn 2. A
    background response the kill interrupted reads as failed."""
    args = ["--max-model-len", "1024", "--kv-cache-memory", "64MiB", "--kv-offload-size", "64MiB",
            "--kv-offload-path", str(tmp_path / "tier"), "--responses-store-path", str(tmp_path / "store.sqlite")]
    system = "You are a helpful assistant for a town guide. Answer politely and briefly. " * 12
    turns, background = [], None
    for i, q in enumerate(["Hello! Who are you?", "Name a fruit."]):
        srv = Server(tmp_path / f"server{i}.log", args).wait_healthy()
        try:
            c = openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=120)
            turns.append(c.responses.create(model=MODEL, instructions=system, input=q, max_output_tokens=8,
                                            previous_response_id=turns[-1].id if turns else None, **T0))
            if background is None:  # still running when the server stops
                background = c.responses.create(model=MODEL, input="Count to 1000.", max_output_tokens=500,
                                                background=True, extra_body={"ignore_eos": True})
                srv.proc.kill()  # SIGKILL: nothing is finished or flushed by a shutdown
                srv.proc.wait(30)
            else:  # after the restart it is failed, never in progress forever
                assert c.responses.retrieve(background.id).status == "failed"
        finally:
            srv.stop()
    first, second = turns
    warm = (first.usage.input_tokens + first.usage.output_tokens - 1) // BLOCK_SIZE * BLOCK_SIZE
    details = second.usage.input_tokens_details
    assert details.cached_tokens >= warm and details.model_extra["cached_tokens_tier"] == details.cached_tokens
