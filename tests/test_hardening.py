"""Hardening of the HTTP server (issue 16): values the engine cannot carry, text the tokenizer cannot encode,
unbounded work (n, body size, over-long text, tokenization off the event loop), unknown and unsupported
fields, the one unhandled-exception handler, API keys and CORS. Round 2 (issue 41): strict JSON types (no
coercion of strings or 0/1 into booleans and numbers), tool messages without the id of an earlier call, and
the size of client-given Prometheus label values.

The session's shared ``tinyvllm serve`` (SmolLM2; tests/conftest.py ``shared_server``) for the request classes; the middleware (500 handler,
API key, CORS) also runs under a real uvicorn in a thread over a stub engine, where a route can be made to
raise.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import types

import httpx
import pytest

from server_utils import SHARED_BODY_CAP, SHARED_MAX_MODEL_LEN, Server, bound_socket

MAX_MODEL_LEN = SHARED_MAX_MODEL_LEN
BODY_CAP = SHARED_BODY_CAP  # the shared server's --max-request-body-bytes


@pytest.fixture(scope="module")
def server(shared_server):
    return shared_server


def _post(server: Server, path: str, body, **kw) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        return httpx.post(server.base + path, content=body, headers={"content-type": "application/json"},
                          timeout=120, **kw)
    return httpx.post(server.base + path, json=body, timeout=120, **kw)


def _assert_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    assert err["param"] == param, err
    return err


CHAT = [{"role": "user", "content": "Say hi."}]


# ----------------------------------------------------------------------------- values the engine cannot carry


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "min_tokens": 2**63}, "min_tokens"),
    ("/v1/completions", {"prompt": "hi", "top_k": 2**64}, "top_k"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [2**64]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "stop_token_ids": [10**7]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "hi", "logprobs": 10**20}, "logprobs"),
    ("/v1/completions", {"prompt": [2**64]}, "prompt"),
    ("/v1/completions", {"prompt": "hi", "n": 10**6}, "n"),
    ("/v1/chat/completions", {"messages": CHAT, "n": 10_000}, "n"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 2}, "prompt"),
])
def test_values_out_of_range_are_400_and_leave_nothing_tracked(server, path, body, param):
    _assert_error(_post(server, path, {"max_tokens": 2, **body}), 400, param)
    assert server.wait_idle() == dict.fromkeys(server.state(), 0)


def test_seed_extremes_are_served(server):
    for seed in (2**63 - 1, -(2**63)):
        r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "n": 2, "seed": seed,
                                              "temperature": 1.0})
        assert r.status_code == 200, r.text
        assert len(r.json()["choices"]) == 2


# ----------------------------------------------------------------------------- text the tokenizer cannot encode

LONE = '"a\\ud800b"'  # valid JSON: a lone UTF-16 surrogate


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"prompt": %s, "max_tokens": 2}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": ["ok", %s], "max_tokens": 2}' % LONE, "prompt"),
    ("/v1/completions", '{"prompt": "hi", "stop": [%s], "max_tokens": 2}' % LONE, "stop"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": %s}]}' % LONE, "messages"),
    ("/tokenize", '{"prompt": %s}' % LONE, "prompt"),
    ("/tokenize", '{"messages": [{"role": "user", "content": %s}]}' % LONE, "messages"),
    ("/detokenize", '{"tokens": [1], "model": %s}' % LONE, "model"),
])
def test_lone_surrogate_is_400_naming_the_field(server, path, body, param):
    err = _assert_error(_post(server, path, body), 400, param)
    assert "not valid Unicode" in err["message"]
    assert server.wait_idle() == dict.fromkeys(server.state(), 0)


# ----------------------------------------------------------------------------- unbounded work


def test_body_over_the_cap_is_413(server):
    big = json.dumps({"prompt": "x" * (BODY_CAP + 10), "max_tokens": 1})
    _assert_error(_post(server, "/v1/completions", big), 413, None)

    def chunks():  # no Content-Length: the cap is counted as the body arrives
        for i in range(0, len(big), 1 << 20):
            yield big[i:i + (1 << 20)].encode()

    r = httpx.post(server.base + "/v1/completions", content=chunks(), headers={"content-type": "application/json"},
                   timeout=120)
    _assert_error(r, 413, None)
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def test_a_chunked_body_whose_last_message_crosses_the_cap_is_answered_without_draining():
    """When the message that crosses the cap is the body's last (``more_body`` false), nothing is left to
    drain: the 413 goes out at once. Reading again would wait DRAIN_SECONDS (5 s) for a message that never
    comes, as the middleware did before (GuardMiddleware over an app that reads its body, at the ASGI level)."""
    import asyncio

    from tinyvllm.entrypoints.openai.middleware import GuardMiddleware

    async def reading_app(scope, receive, send):
        while (await receive()).get("more_body", False):
            pass
        raise AssertionError("the cap must stop the read")

    messages = [{"type": "http.request", "body": b"x" * 600, "more_body": True},
                {"type": "http.request", "body": b"x" * 600, "more_body": False}]
    sent: list[dict] = []

    async def receive():
        assert messages, "receive() called after the body's last message"
        return messages.pop(0)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "state": {}}
    asyncio.run(asyncio.wait_for(GuardMiddleware(reading_app, max_body_bytes=1000)(scope, receive, send), 2))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413


@pytest.mark.parametrize("chunked", [False, True])
def test_the_413_arrives_whole_while_the_client_is_still_sending(server, chunked):
    """The server reads (and drops) the rest of an oversized body before answering, so closing the
    connection does not reset it under the client with the 413 unread (the client here sends the whole
    body before it reads anything, as a simple HTTP client does)."""
    import socket
    from urllib.parse import urlsplit

    u = urlsplit(server.base)
    body = b"x" * (2 * BODY_CAP)
    if chunked:
        head = b"Transfer-Encoding: chunked\r\n"
        step = 1 << 20
        payload = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step])
                           for i in range(0, len(body), step)) + b"0\r\n\r\n"
    else:
        head = b"Content-Length: %d\r\n" % len(body)
        payload = body
    for _ in range(3):  # a reset loses the answer only some of the time: try a few connections
        with socket.create_connection((u.hostname, u.port), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         + head + b"\r\n")
            try:
                sock.sendall(payload)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server may stop reading once it has read its bound: the answer must still come
            got = b""
            while b"\r\n\r\n" not in got or len(got.split(b"\r\n\r\n", 1)[1]) < _content_length(got):
                chunk = sock.recv(65536)  # a reset raises ConnectionResetError here: the test fails
                if not chunk:
                    break
                got += chunk
        assert got.startswith(b"HTTP/1.1 413"), got[:200]
        assert b"max_request_body_bytes" in got.split(b"\r\n\r\n", 1)[1]
    assert httpx.get(server.base + "/health", timeout=10).status_code == 200


def _content_length(raw: bytes) -> int:
    for line in raw.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            return int(v.strip())
    return 1 << 62


def test_text_that_cannot_fit_is_refused_before_tokenizing(server):
    huge = "hello " * 750_000  # 4.5 MB
    err = _assert_error(_post(server, "/v1/completions", {"prompt": huge, "max_tokens": 1}), 400, "prompt")
    assert "too long" in err["message"] and "characters" in err["message"]
    err = _assert_error(_post(server, "/v1/chat/completions",
                              {"messages": [{"role": "user", "content": huge}]}), 400, "messages")
    assert "too long" in err["message"]
    # Text under the bound but over the context is still measured in tokens (the usual message).
    err = _assert_error(_post(server, "/v1/completions", {"prompt": "hello " * 2000, "max_tokens": 1}), 400,
                        "prompt")
    assert "maximum context length" in err["message"]


def test_health_answers_while_a_huge_prompt_is_tokenized(server):
    """100 prompts of ~40k characters each (under the per-text bound, so each is tokenized: ~4 MB, seconds
    of work) are all tokenized before the request is refused for length (a small 400). That runs on the
    tokenization thread, so /health requests sent in the second half of its lifetime complete before it does
    (on the event loop they would all wait for it)."""
    text = "the quick brown fox jumps over the lazy dog " * 900
    done: dict[str, float] = {}

    def big() -> None:
        done["start"] = time.monotonic()
        r = _post(server, "/v1/completions", {"prompt": [text] * 100, "max_tokens": 1})
        done["end"] = time.monotonic()
        done["status"] = r.status_code
        done["message"] = r.json()["error"]["message"]

    t = threading.Thread(target=big)
    t.start()
    health: list[tuple[float, float]] = []
    with httpx.Client(timeout=120) as c:
        while "end" not in done:
            t0 = time.monotonic()
            assert c.get(server.base + "/health").status_code == 200
            health.append((t0, time.monotonic()))
    t.join()
    assert done["status"] == 400 and "maximum context length" in done["message"], done
    mid = (done["start"] + done["end"]) / 2
    late = [h for h in health if h[0] > mid and h[1] < done["end"]]
    assert late, f"no /health answered during the second half of the big request ({len(health)} in all)"


# ----------------------------------------------------------------------------- unknown / unsupported fields


def test_unknown_fields_are_warned_and_unsupported_ones_refused(server):
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate_level": 3})
    assert r.status_code == 200, r.text
    deadline = time.monotonic() + 10
    while "frobnicate_level" not in server.log_tail(20000) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert "ignored: ['frobnicate_level']" in server.log_tail(20000)
    for path, body, param in [
        ("/v1/completions", {"prompt": "hi", "suffix": "end"}, "suffix"),
        ("/v1/completions", {"prompt": "hi", "use_beam_search": True}, "use_beam_search"),
        ("/v1/chat/completions", {"messages": CHAT, "tool_choice": "required"}, "tool_choice"),  # no tools
        ("/v1/chat/completions", {"messages": CHAT, "functions": [{"name": "f"}]}, "functions"),
    ]:
        _assert_error(_post(server, path, body), 400, param)
    # "not used" values of those fields are accepted
    r = _post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "functions": [], "audio": None})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- registration cleanup (in process)


def test_a_failure_after_registration_unregisters_the_request():
    """AsyncLLM.add_request: a payload msgpack cannot carry (a seed forced past int64 after validation), or a
    send that fails, leaves no request in the output processor, the streams or the metrics."""
    from tinyvllm.engine.async_llm import AsyncLLM, InvalidRequestError, _Replica
    from tinyvllm.engine.output_processor import OutputProcessor
    from tinyvllm.engine.tokenizer import load_tokenizer
    from tinyvllm.metrics.prometheus import ServerMetrics
    from tinyvllm.metrics.stats import SchedulerStats
    from tinyvllm.model.loader import resolve_model
    from tinyvllm.sampling_params import SamplingParams

    eng = AsyncLLM.__new__(AsyncLLM)  # no process: the bookkeeping only
    eng.processor = OutputProcessor(load_tokenizer(resolve_model("SmolLM2-135M-Instruct").model_dir))
    eng.metrics = ServerMetrics("m")
    eng._queues, eng._dead, eng._accepting, eng.max_waiting_requests = {}, None, True, None
    eng._replicas = [_Replica(0)]
    eng.stats, eng._num_sent, eng.eos_token_ids, eng.max_model_len, eng.vocab_size = SchedulerStats(), 0, [2], 64, 100

    params = SamplingParams(seed=1)
    params.seed = 2**64  # past validation: what msgpack cannot encode
    with pytest.raises(InvalidRequestError):
        eng.add_request("r1", None, [1, 2], params)
    assert not any(eng.tracked_state().values())

    class Boom:
        def send_multipart(self, *a, **k):
            raise RuntimeError("socket broke")

    eng._in_sock = Boom()
    with pytest.raises(RuntimeError):
        eng.add_request("r2", None, [1, 2], SamplingParams(n=3))
    assert not any(eng.tracked_state().values())


# ----------------------------------------------------------------------------- middleware under a real uvicorn


class _StubEngine(types.SimpleNamespace):
    step_listeners: list = []  # the dashboard hub registers here (never called: the stub runs no step)

    def tracked_state(self) -> dict:
        return {}


@pytest.fixture()
def stub_server():
    """build_app over a stub engine with a ``/boom`` route that raises, served by uvicorn in a thread."""
    import uvicorn

    from tinyvllm.entrypoints.openai.api_server import build_app

    started: list = []

    def serve(**opts):
        engine = _StubEngine(tokenizer=None, model_name="stub", is_running=True, engine_pid=1, max_model_len=8,
                             vocab_size=8, metrics=types.SimpleNamespace(render=lambda: b""),
                             resolved=types.SimpleNamespace(model_dir="/stub"))
        app = build_app(engine, **opts)

        @app.get("/v1/boom")
        async def boom() -> dict:
            raise RuntimeError("kaboom")

        sock = bound_socket()
        port = sock.getsockname()[1]
        srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        th = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
        th.start()
        while not srv.started:
            time.sleep(0.01)
        started.append((srv, th))
        return f"http://127.0.0.1:{port}", port

    yield serve
    for srv, th in started:
        srv.should_exit = True
        th.join(10)


def _raw_requests(port: int, paths: list[str]) -> list[bytes]:
    """Send GETs one after the other on ONE connection (keep-alive); return each raw response."""
    out = []
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        f = s.makefile("rb")
        for p in paths:
            s.sendall(f"GET {p} HTTP/1.1\r\nHost: x\r\nX-Request-Id: rid-{len(out)}\r\n\r\n".encode())
            status = f.readline()
            headers = {}
            while (line := f.readline()) not in (b"\r\n", b""):
                k, v = line.decode().split(":", 1)
                headers[k.strip().lower()] = v.strip()
            body = f.read(int(headers.get("content-length", 0)))
            out.append(status + body)
    return out


def test_unhandled_exception_is_one_log_line_and_keeps_the_connection(stub_server, caplog):
    base, port = stub_server()
    with caplog.at_level(logging.INFO):
        first, second = _raw_requests(port, ["/v1/boom", "/health"])
    assert first.startswith(b"HTTP/1.1 500")
    err = json.loads(first.split(b"\r\n", 1)[1])["error"]
    assert err["type"] == "InternalServerError" and "rid-0" in err["message"]
    assert second.startswith(b"HTTP/1.1 200")  # same connection still served
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "rid-0" in errors[0].getMessage() and errors[0].exc_info is None


def test_api_key_and_cors(stub_server):
    base, _ = stub_server(api_keys=["sekrit"], allowed_origins=["http://ok.example"])
    r = httpx.get(base + "/v1/models")
    _assert_error(r, 401, None)
    assert r.json()["error"]["type"] == "AuthenticationError"
    _assert_error(httpx.get(base + "/v1/models", headers={"Authorization": "Bearer wrong"}), 401, None)
    _assert_error(httpx.get(base + "/debug/state", headers={"Authorization": "sekrit"}), 401, None)
    assert httpx.get(base + "/v1/models", headers={"Authorization": "Bearer sekrit"}).status_code == 200
    assert httpx.get(base + "/health").status_code == 200  # open paths
    assert httpx.get(base + "/metrics").status_code == 200
    pre = httpx.options(base + "/v1/models", headers={"Origin": "http://ok.example",
                                                      "Access-Control-Request-Method": "GET"})
    assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "http://ok.example"
    bad = httpx.options(base + "/v1/models", headers={"Origin": "http://evil.example",
                                                      "Access-Control-Request-Method": "GET"})
    assert "access-control-allow-origin" not in bad.headers
    # a 401 still carries the CORS header, so a browser client can read the error
    r = httpx.get(base + "/v1/models", headers={"Origin": "http://ok.example"})
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "http://ok.example"


def test_no_key_and_no_cors_by_default(stub_server):
    base, _ = stub_server()
    assert httpx.get(base + "/v1/models").status_code == 200
    r = httpx.get(base + "/v1/models", headers={"Origin": "http://ok.example"})
    assert "access-control-allow-origin" not in r.headers


def test_server_flags_parse():
    import argparse

    from tinyvllm.entrypoints.openai.cli_args import add_server_args

    p = argparse.ArgumentParser()
    add_server_args(p)
    a = p.parse_args([])
    assert a.host == "127.0.0.1" and a.api_key is None and a.allowed_origins is None
    assert a.max_request_body_bytes > 0 and "/health" in a.open_paths and "/metrics" in a.open_paths
    a = p.parse_args(["--api-key", "k", "--allowed-origins", "*", "--open-paths", "/health"])
    assert a.api_key == ["k"] and a.allowed_origins == ["*"] and a.open_paths == ["/health"]


# ----------------------------------------------------------------------------- echo / prompt_logprobs / logit_bias


def test_echo_logprobs_score_the_prompt(server):
    prompt = "The capital of France is Paris. The capital of Italy is"
    ids = _post(server, "/tokenize", {"prompt": prompt}).json()["tokens"]
    body = {"prompt": prompt, "max_tokens": 3, "temperature": 0, "echo": True, "logprobs": 1}
    results = []
    for _ in range(2):  # the second run finds the prompt in the prefix cache: still scored in full
        r = _post(server, "/v1/completions", body)
        assert r.status_code == 200, r.text
        ch = r.json()["choices"][0]
        lp = ch["logprobs"]
        assert ch["text"].startswith(prompt)
        assert len(lp["tokens"]) == len(ids) + 3 and lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        assert all(isinstance(v, float) and v <= 0 for v in lp["token_logprobs"][1:])
        assert lp["text_offset"][0] == 0 and lp["text_offset"] == sorted(lp["text_offset"])
        assert "".join(lp["tokens"][:len(ids)]).endswith("Italy is")
        results.append(lp["token_logprobs"])
    assert results[0] == results[1]
    # vLLM's prompt_logprobs field gives the same numbers
    r = _post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 2})
    plp = r.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        assert abs(plp[i][str(ids[i])]["logprob"] - results[0][i]) < 1e-6
        assert len(plp[i]) >= 2  # the token plus the top 2 (overlapping when it is one of them)
    # streaming: the first chunk carries the echoed prompt and its logprobs
    with httpx.stream("POST", server.base + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    first = chunks[0]["choices"][0]
    assert first["text"].startswith(prompt) and first["logprobs"]["token_logprobs"][0] is None
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == results[0]
    assert server.wait_idle() == dict.fromkeys(server.state(), 0)


def test_logit_bias_over_http(server):
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0}
    forced = _post(server, "/v1/completions", {**body, "logit_bias": {"1234": 100}}).json()["choices"][0]["text"]
    assert forced == _post(server, "/detokenize", {"tokens": [1234] * 3}).json()["prompt"]
    for bias, in [({"1234": 101},), ({"abc": 1},), ({str(10**7): 1},)]:
        _assert_error(_post(server, "/v1/completions", {**body, "logit_bias": bias}), 400, "logit_bias")


def test_bind_port_zero_reports_the_port(tmp_path):
    """``serve --port 0 --port-file F``: the server binds a port the kernel picks and writes it to F (what
    tests/server_utils.Server reads); an address in use is an ``OSError`` (logged, exit code 1)."""
    from tinyvllm.entrypoints.openai.api_server import _bind

    port_file = tmp_path / "port"
    sock = _bind("127.0.0.1", 0, str(port_file))
    try:
        port = int(port_file.read_text())
        assert port == sock.getsockname()[1] != 0
        sock.listen()
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass
        with pytest.raises(OSError):
            _bind("127.0.0.1", port)
        assert list(tmp_path.iterdir()) == [port_file]  # no temporary file left behind
    finally:
        sock.close()


def test_accepted_connections_have_tcp_nodelay():
    """The listening socket from ``_bind``, served as uvicorn serves it (``loop.create_server(sock=...)``):
    each accepted connection has TCP_NODELAY. asyncio sets it only where the socket's proto is IPPROTO_TCP,
    which a bare ``socket.socket(family, SOCK_STREAM)`` is not (proto 0); without it Nagle + the client's
    delayed ACK added ~40 ms to every request on a kept-alive connection (measured 44 ms per /health)."""
    import asyncio

    from tinyvllm.entrypoints.openai.api_server import _bind

    async def main() -> int:
        loop = asyncio.get_running_loop()
        accepted: asyncio.Future = loop.create_future()

        class Proto(asyncio.Protocol):
            def connection_made(self, transport):
                sock = transport.get_extra_info("socket")
                accepted.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Proto, sock=_bind("127.0.0.1", 0))
        try:
            port = server.sockets[0].getsockname()[1]
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            nodelay = await asyncio.wait_for(accepted, 10)
            writer.close()
            return nodelay
        finally:
            server.close()

    assert asyncio.run(main()) != 0


# ----------------------------------------------------------------------------- strict types (issue 41)

_BASES = {  # a valid body of each request model (and its endpoint)
    "CompletionRequest": ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
    "ChatCompletionRequest": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1}),
    "TokenizeRequest": ("/tokenize", {"prompt": "hi"}),
    "DetokenizeRequest": ("/detokenize", {"tokens": [1]}),
}

# (model, fields replacing the base body's, the field named): booleans take only true/false, integers only
# JSON integers (16.0 too is refused), floats JSON numbers but no string nor boolean; nested models too.
STRICT_REFUSED = [
    ("ChatCompletionRequest", {"parallel_tool_calls": "false"}, "parallel_tool_calls"),
    ("ChatCompletionRequest", {"parallel_tool_calls": 0}, "parallel_tool_calls"),
    ("ChatCompletionRequest", {"stream": "true"}, "stream"),
    ("ChatCompletionRequest", {"logprobs": "true"}, "logprobs"),
    ("ChatCompletionRequest", {"logprobs": 1}, "logprobs"),
    ("ChatCompletionRequest", {"add_generation_prompt": "false"}, "add_generation_prompt"),
    ("ChatCompletionRequest", {"continue_final_message": 0}, "continue_final_message"),
    ("ChatCompletionRequest", {"max_completion_tokens": "16"}, "max_completion_tokens"),
    ("ChatCompletionRequest", {"top_logprobs": 2.0}, "top_logprobs"),
    ("ChatCompletionRequest", {"stream": True, "stream_options": {"include_usage": "true"}}, "stream_options"),
    ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi", "name": 7}]}, "messages"),
    ("CompletionRequest", {"max_tokens": "16"}, "max_tokens"),
    ("CompletionRequest", {"max_tokens": 16.0}, "max_tokens"),
    ("CompletionRequest", {"max_tokens": True}, "max_tokens"),
    ("CompletionRequest", {"echo": "true"}, "echo"),
    ("CompletionRequest", {"logprobs": True}, "logprobs"),
    ("CompletionRequest", {"ignore_eos": "1"}, "ignore_eos"),
    ("CompletionRequest", {"skip_special_tokens": 0}, "skip_special_tokens"),
    ("CompletionRequest", {"prefix_cache_debug": "false"}, "prefix_cache_debug"),
    ("CompletionRequest", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ("CompletionRequest", {"add_special_tokens": "false"}, "add_special_tokens"),
    ("CompletionRequest", {"temperature": "0.5"}, "temperature"),
    ("CompletionRequest", {"temperature": True}, "temperature"),
    ("CompletionRequest", {"top_p": "1"}, "top_p"),
    ("CompletionRequest", {"seed": "7"}, "seed"),
    ("CompletionRequest", {"n": 2.0}, "n"),
    ("CompletionRequest", {"min_tokens": "1"}, "min_tokens"),
    ("CompletionRequest", {"stop_token_ids": ["2"]}, "stop_token_ids"),
    ("CompletionRequest", {"logit_bias": {"5": "1"}}, "logit_bias"),
    ("CompletionRequest", {"prompt": [True, False]}, "prompt"),
    ("TokenizeRequest", {"add_special_tokens": "false"}, "add_special_tokens"),
    ("TokenizeRequest", {"add_generation_prompt": 1, "prompt": None, "messages": CHAT}, "add_generation_prompt"),
    ("DetokenizeRequest", {"tokens": ["1"]}, "tokens"),
    ("DetokenizeRequest", {"tokens": [1.0]}, "tokens"),
]
# Stay accepted: a JSON integer for a float (as OpenAI), null for an optional field, real booleans.
STRICT_ACCEPTED = [
    ("CompletionRequest", {"temperature": 1, "top_p": 1, "min_p": 0, "presence_penalty": 0,
                           "frequency_penalty": 0, "repetition_penalty": 1, "logit_bias": {"5": 1}}),
    ("CompletionRequest", {"echo": False, "stream": None, "seed": None, "top_k": None, "ignore_eos": True}),
    ("ChatCompletionRequest", {"parallel_tool_calls": False, "logprobs": True, "top_logprobs": 2,
                               "stream": True, "stream_options": {"include_usage": True}}),
    ("TokenizeRequest", {"add_special_tokens": False}),
]


def _ids(cases):
    return [f"{m}-{'-'.join(f'{k}={v!r}' for k, v in body.items() if k != 'messages')}"[:80] for m, body, *_ in cases]


@pytest.mark.parametrize("model,body,field", STRICT_REFUSED, ids=_ids(STRICT_REFUSED))
def test_request_models_coerce_nothing(model, body, field):
    """The pydantic models themselves (no server): a value of another JSON type is an error at that field."""
    from pydantic import ValidationError

    from tinyvllm.entrypoints.openai import protocol

    with pytest.raises(ValidationError) as e:
        getattr(protocol, model).model_validate({**_BASES[model][1], **body})
    assert e.value.errors()[0]["loc"][0] == field, e.value.errors()


@pytest.mark.parametrize("model,body", STRICT_ACCEPTED, ids=_ids(STRICT_ACCEPTED))
def test_request_models_keep_ints_for_floats(model, body):
    from tinyvllm.entrypoints.openai import protocol

    req = getattr(protocol, model).model_validate({**_BASES[model][1], **body})
    if "temperature" in body:
        assert req.temperature == 1.0 and isinstance(req.temperature, float)
    if hasattr(req, "to_sampling_params"):
        req.to_sampling_params()


def test_strict_types_over_http(server):
    """Every refused case of the models is a 400 naming the field (and saying what was sent) over HTTP;
    the accepted ones are served; booleans inside free-form objects are checked by hand."""
    for model, body, field in STRICT_REFUSED:
        path, base = _BASES[model]
        err = _assert_error(_post(server, path, {**base, **body}), 400, field)
        assert field in err["message"] and "got " in err["message"], err
    for model, body in STRICT_ACCEPTED:
        path, base = _BASES[model]
        r = _post(server, path, {**base, **body})
        assert r.status_code == 200, r.text
    chat = {"messages": CHAT, "max_tokens": 1}
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": "true"}}
    err = _assert_error(_post(server, "/v1/chat/completions", {**chat, "response_format": rf}), 400,
                        "response_format")
    assert "response_format.json_schema.strict must be a boolean" in err["message"]
    tools = [{"type": "function", "function": {"name": "f", "strict": "false", "parameters": {"type": "object"}}}]
    err = _assert_error(_post(server, "/v1/chat/completions", {**chat, "tools": tools}), 400, "tools")
    assert "tools[0].function.strict" in err["message"]
    rf["json_schema"]["strict"] = True
    assert _post(server, "/v1/chat/completions", {**chat, "response_format": rf}).status_code == 200
    assert server.wait_idle() == dict.fromkeys(server.state(), 0)


# ----------------------------------------------------------------------------- tool messages (issue 41)

_CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}
_ASSISTANT = {"role": "assistant", "content": None, "tool_calls": [_CALL]}
_ASK = {"role": "user", "content": "Weather in Paris?"}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("messages,index,says", [
    ([_ASK, _ASSISTANT, {"role": "tool", "content": "21 C"}], 2, "needs a tool_call_id"),
    ([_ASK, _ASSISTANT, {"role": "tool", "content": "21 C", "tool_call_id": None}], 2, "needs a tool_call_id"),
    ([_ASK, _ASSISTANT, {"role": "tool", "content": "21 C", "tool_call_id": ""}], 2, "needs a tool_call_id"),
    ([_ASK, _ASSISTANT, {"role": "tool", "content": "21 C", "tool_call_id": "call_2"}], 2, "is not the id"),
    ([_ASK, {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}, _ASSISTANT], 1, "is not the id"),
    ([_ASK, {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}], 1, "is not the id"),
], ids=["missing", "null", "empty", "unknown-id", "before-its-call", "no-assistant-call"])
def test_tool_message_needs_the_id_of_an_earlier_call(server, path, messages, index, says):
    body = {"messages": messages, "max_tokens": 1} if path != "/tokenize" else {"messages": messages}
    param = f"messages[{index}].tool_call_id"
    err = _assert_error(_post(server, path, body), 400, param)
    assert err["message"].startswith(param) and says in err["message"], err
    ok = [_ASK, _ASSISTANT, {"role": "tool", "content": "21 C", "tool_call_id": "call_1"}]
    r = _post(server, path, {**body, "messages": ok})
    assert r.status_code == 200, r.text


# ----------------------------------------------------------------------------- metric label sizes (issue 41)


def test_bounded_label():
    from tinyvllm.metrics.prometheus import MAX_LABEL_BYTES, bounded_label

    assert bounded_label("alice") == "alice" and bounded_label("") == ""
    assert bounded_label("a" * MAX_LABEL_BYTES) == "a" * MAX_LABEL_BYTES
    long_a, long_b = "x" * 100 + "a", "x" * 100 + "b"
    la, lb = bounded_label(long_a), bounded_label(long_b)
    assert la != lb and la.startswith("x" * 40) and len(la.encode()) <= MAX_LABEL_BYTES
    assert bounded_label(long_a) == la  # stable
    cut = bounded_label("é" * 100)  # 2-byte characters: the prefix holds whole characters only
    assert len(cut.encode()) <= MAX_LABEL_BYTES and cut.split("~")[0] == "é" * 25


METRICS_MAX_BYTES = 1 << 20  # /metrics stays under this whatever clients send as `user` (README)


def test_metrics_stay_bounded_whatever_users_are_sent():
    """300 users of 12 KiB each, of the characters that escaping doubles, through the per-request metric
    bookkeeping: 256 distinct labels (then "other"), each cut to 64 bytes; /metrics stays under 1 MiB."""
    from tinyvllm.metrics.prometheus import MAX_LABEL_BYTES, MAX_USER_LABELS, ServerMetrics

    m = ServerMetrics("SmolLM2-135M-Instruct")
    kv = {"kv_block_seconds": 1.5, "prefill_tokens_computed": 10, "prefill_tokens_cached": 2}
    for i in range(300):
        user = f"{i}" + '"\\\n' * (1 << 12)
        m.request_added(f"r{i}", 0.0, user)
        m.record_output(types.SimpleNamespace(request_id=f"r{i}", outputs=[], finished=True, prompt_token_ids=[1],
                                              num_cached_tokens=0, kv_cost=kv), now=1.0)
    text = m.render()
    users = {line.split('user="', 1)[1].rsplit('"}', 1)[0] for line in text.decode().splitlines()
             if line.startswith("tinyvllm:user_requests_total")}
    assert len(users) == MAX_USER_LABELS + 1 and "other" in users
    assert all(len(u.encode()) <= 2 * MAX_LABEL_BYTES for u in users)  # escaped: at most twice the bytes
    assert len(text) < METRICS_MAX_BYTES, len(text)


def test_a_megabyte_user_keeps_metrics_small(server):
    from tinyvllm.metrics.prometheus import bounded_label

    user = "big-user-" + "u" * (1 << 20)
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "user": user})
    assert r.status_code == 200, r.text
    label = f'user="{bounded_label(user)}"'
    deadline = time.monotonic() + 10
    while label not in (text := httpx.get(server.base + "/metrics", timeout=10).text):
        assert time.monotonic() < deadline, "the user's counters never appeared"
        time.sleep(0.1)
    assert len(text.encode()) < METRICS_MAX_BYTES and "u" * 100 not in text
