"""Anthropic's Messages API (``/v1/messages``) through the real server: a ``tinyvllm serve`` process with the
real SmolLM2-135M-Instruct, driven by the official ``anthropic`` SDK. The endpoint is a translation layer
onto the chat path, so these tests check the translation: text, streaming (the same message as the
non-streamed one at temperature 0), tool use (the input validates against the tool's ``input_schema``), a
tool_result round trip, stop sequences, count_tokens, and 400s in Anthropic's error shape.

The session's shared server (tests/conftest.py ``shared_server``); every generation is short.
"""

from __future__ import annotations

import anthropic
import httpx
import jsonschema
import pytest

from server_utils import KEYED_SERVER_KEYS, SHARED_BODY_CAP

MODEL = "SmolLM2-135M-Instruct"
HELLO = [{"role": "user", "content": "Say hello in one short sentence."}]
WEATHER = {"name": "get_weather", "description": "Current weather in a city",
           "input_schema": {"type": "object", "properties": {
               "city": {"type": "string", "maxLength": 30},
               "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
               "required": ["city", "unit"], "additionalProperties": False}}
T0 = {"temperature": 0}  # anthropic 2.x has no temperature argument: sent as an extra body field
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server  # the session's (tests/conftest.py): its flags include the Hermes tool-call parser


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.base, api_key="none", max_retries=0, timeout=120)


def test_create_text(client):
    m = client.messages.create(model=MODEL, max_tokens=16, messages=HELLO, extra_body=T0,
                               system="You are a friendly assistant.")
    assert m.id.startswith("msg_") and m.type == "message" and m.role == "assistant" and m.model == MODEL
    assert m.stop_reason in ("end_turn", "max_tokens") and m.stop_sequence is None
    assert len(m.content) == 1 and m.content[0].type == "text" and m.content[0].text
    assert 0 < m.usage.output_tokens <= 16
    assert m.usage.input_tokens > 0 and m.usage.cache_read_input_tokens is not None


def test_stream_equals_create(client):
    kw = dict(model=MODEL, max_tokens=24, messages=HELLO, extra_body=T0,
              system=[{"type": "text", "text": "You are terse."}])
    full = client.messages.create(**kw)
    events = []
    with client.messages.stream(**kw) as s:
        for ev in s:
            events.append(ev.type)
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    assert {"content_block_start", "content_block_delta", "content_block_stop", "message_delta"} <= set(events)
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in full.content]
    assert final.stop_reason == full.stop_reason
    assert final.usage.output_tokens == full.usage.output_tokens


def test_raw_sse_event_lines(server):
    body = {"model": MODEL, "max_tokens": 4, "messages": HELLO, "stream": True}
    with httpx.stream("POST", server.base + "/v1/messages", json=body, timeout=60) as r:
        assert r.status_code == 200
        text = "".join(r.iter_text())
    names = [line.split(": ", 1)[1] for line in text.splitlines() if line.startswith("event: ")]
    assert names[0] == "message_start" and "ping" in names and names[-2:] == ["message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_tool_use_any(client, stream):
    kw = dict(model=MODEL, max_tokens=64, messages=ASK, extra_body=T0, tools=[WEATHER],
              tool_choice={"type": "any", "disable_parallel_tool_use": True})
    if stream:
        with client.messages.stream(**kw) as s:
            m = s.get_final_message()
    else:
        m = client.messages.create(**kw)
    assert m.stop_reason == "tool_use"
    uses = [b for b in m.content if b.type == "tool_use"]
    assert len(uses) == 1 and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
    jsonschema.validate(uses[0].input, WEATHER["input_schema"])


def test_tool_result_round_trip(client):
    first = client.messages.create(model=MODEL, max_tokens=64, messages=ASK, extra_body=T0, tools=[WEATHER],
                                   tool_choice={"type": "tool", "name": "get_weather",
                                                "disable_parallel_tool_use": True})
    use = next(b for b in first.content if b.type == "tool_use")
    messages = ASK + [
        {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                      "content": [{"type": "text", "text": "18 degrees, sunny"}]}]}]
    second = client.messages.create(model=MODEL, max_tokens=24, messages=messages, extra_body=T0,
                                    tools=[WEATHER], tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert second.content and second.content[0].type == "text"
    # a tool_result that answers no tool_use is refused, naming the field
    bad = messages[:1] + messages[2:]
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model=MODEL, max_tokens=8, messages=bad, tools=[WEATHER])
    assert "tool_call_id" in str(e.value)


def test_stop_sequences(client):
    free = client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=T0)
    text = free.content[0].text
    words = text.split()
    assert len(words) >= 2, text
    stop = words[1]
    m = client.messages.create(model=MODEL, max_tokens=24, messages=HELLO, extra_body=T0, stop_sequences=[stop])
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == stop
    assert stop not in m.content[0].text if m.content else True


def test_count_tokens(client):
    r = client.messages.count_tokens(model=MODEL, messages=HELLO)
    m = client.messages.create(model=MODEL, max_tokens=1, messages=HELLO)
    assert r.input_tokens > 0
    assert r.input_tokens == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > client.messages.count_tokens(model=MODEL, messages=ASK).input_tokens


def _bad(server, body: dict, field: str) -> None:
    r = httpx.post(server.base + "/v1/messages", json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
    assert field in err["error"]["message"], err


def test_bad_input_is_400_in_anthropic_shape(client, server):
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "system", "content": "hi"}])
    _bad(server, {"model": MODEL, "messages": HELLO}, "max_tokens")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [image]}]},
         "messages[0].content[0].type")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": [{"role": "robot", "content": "hi"}]},
         "messages[0].role")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": HELLO, "thinking": {"type": "enabled",
                                                                                 "budget_tokens": 1024}},
         "thinking")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": HELLO,
                  "tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type")
    _bad(server, {"model": MODEL, "max_tokens": "8", "messages": HELLO}, "max_tokens")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": HELLO, "tool_choice": {"type": "any"}},
         "tool_choice")
    # unknown fields are ignored
    r = httpx.post(server.base + "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": HELLO,
                                                       "some_future_field": 1}, timeout=30)
    assert r.status_code == 200, r.text
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="no-such-model", max_tokens=8, messages=HELLO)


def test_assistant_prefill_is_continued(client, server):
    # A final assistant message is continued, as the chat endpoint's continue_final_message does
    messages = HELLO + [{"role": "assistant", "content": "Hello there, my"}]
    m = client.messages.create(model=MODEL, max_tokens=12, extra_body=T0, messages=messages)
    chat = httpx.post(server.base + "/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": messages, "max_tokens": 12, "temperature": 0,
        "continue_final_message": True, "add_generation_prompt": False}).json()
    assert m.content and m.content[0].text == chat["choices"][0]["message"]["content"]
    assert m.usage.output_tokens == chat["usage"]["completion_tokens"]


def test_bad_sampling_values_name_the_field(server):
    for field, value in (("temperature", -1.0), ("top_p", 2.0), ("top_k", -5), ("max_tokens", 0),
                         ("max_tokens", 100000)):
        _bad(server, {"model": MODEL, "max_tokens": 8, "messages": HELLO, field: value}, field)
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": HELLO, "stop_sequences": [""]}, "stop")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": HELLO, "system": [{"type": "image"}]}, "system[0]")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": []}, "messages")
    _bad(server, {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "x", "name": "f", "input": {}}]}]}, "messages[0].content[0]")


def test_api_key_as_x_api_key_or_bearer(keyed_server):
    # --api-key (the session's keyed server, tests/conftest.py): the SDK's x-api-key header is accepted as well as
    # Authorization: Bearer; a wrong key is a 401 in Anthropic's shape (authentication_error)
    srv, key = keyed_server, KEYED_SERVER_KEYS[0]
    ok = anthropic.Anthropic(base_url=srv.base, api_key=key, max_retries=0, timeout=60)
    assert ok.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    bearer = anthropic.Anthropic(base_url=srv.base, auth_token=key, max_retries=0, timeout=60)
    assert bearer.messages.count_tokens(model=MODEL, messages=HELLO).input_tokens > 0
    bad = anthropic.Anthropic(base_url=srv.base, api_key="wrong", max_retries=0, timeout=60)
    with pytest.raises(anthropic.AuthenticationError) as e:
        bad.messages.create(model=MODEL, max_tokens=2, messages=HELLO)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    # a body over --max-request-body-bytes: 413, in Anthropic's shape on /v1/messages, OpenAI's elsewhere
    big = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "x" * SHARED_BODY_CAP}]}
    with pytest.raises(anthropic.APIStatusError) as e:
        ok.messages.create(**big)
    assert e.value.status_code == 413 and e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "request_too_large"
    r = httpx.post(srv.base + "/v1/chat/completions", json=big, headers={"Authorization": f"Bearer {key}"})
    assert r.status_code == 413 and r.json()["error"]["code"] == 413


@pytest.mark.parametrize("path,anthropic_shape", [("/v1/messages", True), ("/v1/chat/completions", False)])
def test_unhandled_error_is_a_500_in_the_paths_shape(path, anthropic_shape):
    """GuardMiddleware, the one handler of exceptions a route lets escape: a 500 in Anthropic's error shape on
    the Messages API's paths, OpenAI's elsewhere (the middleware itself, over an app that raises)."""
    import asyncio

    from tinyvllm.entrypoints.openai.middleware import GuardMiddleware

    async def broken_app(scope, receive, send):
        raise RuntimeError("boom")

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=GuardMiddleware(broken_app))
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json={})

    r = asyncio.run(call())
    assert r.status_code == 500
    body = r.json()
    if anthropic_shape:
        assert body["type"] == "error" and body["error"]["type"] == "api_error" and "RuntimeError" in \
            body["error"]["message"]
    else:
        assert body["error"]["code"] == 500 and "RuntimeError" in body["error"]["message"]
