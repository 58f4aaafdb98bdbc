"""Property-based fuzzing of the whole HTTP API from its OpenAPI schema (schemathesis): no response >= 500,
and the server answers normally afterwards with nothing left tracked.

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
TOKEN_CAP = 4  # max_tokens / max_completion_tokens / min_tokens in the fuzzed schema


def _schema() -> dict:
    from tinyvllm.entrypoints.openai.api_server import build_app

    stub = types.SimpleNamespace(tokenizer=None, model_name="m", step_listeners=[])
    spec = build_app(stub).openapi()  # type: ignore[arg-type]
    for comp in spec.get("components", {}).get("schemas", {}).values():
        for name, prop in comp.get("properties", {}).items():
            if name in ("max_tokens", "max_completion_tokens", "min_tokens"):
                for alt in prop.get("anyOf", [prop]):
                    if alt.get("type") == "integer":
                        alt["maximum"] = TOKEN_CAP
    return spec


schema = schemathesis.openapi.from_dict(_schema())


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = Server(tmp_path_factory.mktemp("fuzz") / "server.log",
                 ["--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "8", "--kv-cache-memory", "32MiB",
                  "--max-request-body-bytes", "1000000"],
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
        assert err is not None and {"message", "type", "param", "code"} <= set(err), response.text


def test_server_is_healthy_after_fuzzing(server):
    """Runs after the fuzzing (file order): the server still serves, and holds no request or KV block."""
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1, r.text
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200
    assert not any(server.wait_idle().values()), server.state()
    assert server.proc.poll() is None
