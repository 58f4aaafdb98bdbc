"""Property-based fuzzing of the whole HTTP API from its OpenAPI schema (schemathesis): no response >= 500,
and the server answers normally afterwards with nothing left tracked. Every boolean / integer / number field
of the schema is also sent values of another JSON type (strings, 0/1, 1.0), which must be 400s naming it.

The schema is the app's own (``build_app(...).openapi()``, built over a stub engine at import: no server is
needed to collect the tests); the calls go to a real ``tinyvllm serve`` (SmolLM2) with a small context, and
the schema's token counts are capped so each generation stays short. Bounded: ``MAX_EXAMPLES`` per
operation, no deadline (the machine is shared), both valid and invalid (negative) cases.
"""

from __future__ import annotations

import types

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, settings

from server_utils import Server

MAX_EXAMPLES = 25
MAX_MODEL_LEN = 128
TOKEN_CAP = 4  # max_tokens / max_completion_tokens / min_tokens / max_output_tokens in the fuzzed schema


def _schema() -> dict:
    from tinyvllm.entrypoints.openai.api_server import build_app

    stub = types.SimpleNamespace(tokenizer=None, model_name="m", step_listeners=[])
    spec = build_app(stub).openapi()  # type: ignore[arg-type]
    # a Responses request always caps its output (its default is the rest of the context: slow, and not the point)
    responses = spec["components"]["schemas"]["ResponsesRequest"]
    responses["required"] = sorted(set(responses.get("required", [])) | {"max_output_tokens"})
    responses["properties"]["max_output_tokens"] = {"type": "integer", "title": "Max Output Tokens"}
    for comp in spec.get("components", {}).get("schemas", {}).values():
        for name, prop in comp.get("properties", {}).items():
            if name in ("max_tokens", "max_completion_tokens", "min_tokens", "max_output_tokens"):
                for alt in prop.get("anyOf", [prop]):
                    if alt.get("type") == "integer":
                        alt["maximum"] = TOKEN_CAP
    return spec


schema = schemathesis.openapi.from_dict(_schema())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fuzz")
    srv = Server(tmp / "server.log",
                 ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--kv-cache-memory", "32MiB",
                  "--max-request-body-bytes", "1000000", "--responses-store-path", str(tmp / "responses.sqlite")],
                 env={"TINYVLLM_MAX_N_SEQUENCES": "8"})
    try:
        srv.wait_healthy()
        yield srv
    finally:
        srv.stop()


@pytest.mark.timeout(900)
@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, phases=[Phase.explicit, Phase.generate],
          suppress_health_check=list(HealthCheck), database=None)
def test_no_response_is_a_server_error(case, server):
    response = case.call(base_url=server.base, timeout=120)
    assert response.status_code < 500, (f"{case.method} {case.path} -> {response.status_code}: "
                                        f"{response.text[:500]}\n{server.log_tail(2000)}")
    ctype = response.headers.get("content-type") or ""
    ctype = ctype[0] if isinstance(ctype, list) and ctype else str(ctype)
    if response.status_code >= 400 and ctype.startswith("application/json"):
        err = response.json().get("error")
        if case.path.startswith("/v1/messages"):  # Anthropic's Messages API: Anthropic's error shape
            assert response.json().get("type") == "error" and {"message", "type"} <= set(err), response.text
            return
        assert err is not None and {"message", "type", "param", "code"} <= set(err), response.text


# A valid body per request schema; each boolean / integer / number field of the schema then gets values of
# another JSON type, which the strict request models refuse (400 naming the field; issue 41).
_BASES = {"CompletionRequest": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
          "ChatCompletionRequest": ("/v1/chat/completions",
                                    {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          "TokenizeRequest": ("/tokenize", {"prompt": "hi"}),
          "MessagesRequest": ("/v1/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
          "CountTokensRequest": ("/v1/messages/count_tokens", {"messages": [{"role": "user", "content": "hi"}]}),
          "DetokenizeRequest": ("/detokenize", {"tokens": [1]}),
          "ResponsesRequest": ("/v1/responses", {"input": "hi", "max_output_tokens": 1})}
_WRONG = {"boolean": ["true", "false", 1, 0], "integer": ["1", 1.0, True], "number": ["1.0", True]}


def _typed_fields() -> list[tuple[str, str, str]]:
    """(schema, field, JSON type) of every scalar boolean / integer / number field of the request schemas."""
    out = []
    for name, comp in _schema()["components"]["schemas"].items():
        if name not in _BASES:
            continue
        for field, prop in comp.get("properties", {}).items():
            kinds = {alt.get("type") for alt in prop.get("anyOf", [prop])} - {"null"}
            if len(kinds) == 1 and (kind := kinds.pop()) in _WRONG:
                out.append((name, field, kind))
    return out


def test_every_typed_field_is_strict(server):
    """Every boolean, integer and number field of every request schema, given a string (or a boolean for a
    number, a float for an integer, 0/1 for a boolean): 400 naming the field, never coerced nor a 500."""
    fields = _typed_fields()
    assert {f for _, f, _ in fields} >= {"stream", "echo", "logprobs", "parallel_tool_calls", "prefix_cache_debug",
                                          "ignore_eos", "skip_special_tokens", "add_generation_prompt",
                                          "max_tokens", "n", "seed", "temperature", "top_p"}
    with httpx.Client(base_url=server.base, timeout=120) as c:
        for schema_name, field, kind in fields:
            path, base = _BASES[schema_name]
            for value in _WRONG[kind]:
                r = c.post(path, json={**base, field: value})
                assert r.status_code == 400, (schema_name, field, value, r.status_code, r.text[:300])
                if path.startswith("/v1/messages"):  # Anthropic's error shape has no param: the message names it
                    assert r.json()["error"]["message"].startswith(f"invalid request: {field}:"), r.text[:300]
                    continue
                assert r.json()["error"]["param"] == field, (schema_name, field, value, r.text[:300])


def test_server_is_healthy_after_fuzzing(server):
    """Runs after the fuzzing (file order): the server still serves, and holds no request or KV block."""
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    assert not any(server.wait_idle().values()), server.state()
    assert server.proc.poll() is None
