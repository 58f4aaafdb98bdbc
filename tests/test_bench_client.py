"""Tests of the benchmark client (tinyvllm.benchmarks) against a stub server.

The stub (tests/stub_openai_server.py) streams with known delays: first token
after 0.2 s, then one every 0.05 s. The machine running the tests is shared, so
a timing assertion here is only ever one-sided: a token cannot arrive before the
stub sent it, and the client never starts a request before its planned time; it
may do either later by any amount. Everything else is checked as arithmetic
identities between what the client recorded and what it reports.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stub_openai_server import StubServer  # noqa: E402

from tinyvllm.benchmarks import datasets as ds  # noqa: E402
from tinyvllm.benchmarks import report  # noqa: E402
from tinyvllm.benchmarks.metrics import RequestRecord, compute_metrics, peak_concurrency  # noqa: E402
from tinyvllm.benchmarks.serve import (  # noqa: E402
    add_serve_args,
    arrival_times,
    main_serve,
    run_benchmark,
)

pytestmark = pytest.mark.timeout(60)

FIRST, GAP = 0.2, 0.05


@pytest.fixture(scope="module")
def stub():
    with StubServer(first_token_delay=FIRST, token_delay=GAP) as s:
        yield s


@pytest.fixture
def server(stub):
    stub.reset()
    return stub


@pytest.fixture(scope="module")
def fast_stub():
    with StubServer(first_token_delay=0.02, token_delay=0.005) as s:
        yield s


def _specs(n: int, max_tokens: int, words: int = 8, tag: str = "") -> list[ds.RequestSpec]:
    return [
        ds.RequestSpec(prompt=f"{tag} request {i} " + "w " * words, max_tokens=max_tokens, prompt_len=words)
        for i in range(n)
    ]


def _run(*args, **kw):
    return asyncio.run(run_benchmark(*args, **kw))


# ------------------------------------------------------------------ datasets


def test_random_dataset_deterministic_and_seeded():
    a = ds.random_dataset(20, 50, 10, range_ratio=0.5, seed=1)
    b = ds.random_dataset(20, 50, 10, range_ratio=0.5, seed=1)
    c = ds.random_dataset(20, 50, 10, range_ratio=0.5, seed=2)
    assert [(x.prompt, x.max_tokens) for x in a] == [(x.prompt, x.max_tokens) for x in b]
    assert [x.prompt for x in a] != [x.prompt for x in c]
    for x in a:
        assert 25 <= x.prompt_len <= 75 and 5 <= x.max_tokens <= 15
        assert len(x.prompt.split()) == x.prompt_len  # one word ~ one token
    assert len({x.prompt_len for x in a}) > 1  # lengths actually vary
    fixed = ds.random_dataset(5, 30, 7, seed=0)
    assert all(x.prompt_len == 30 and x.max_tokens == 7 for x in fixed)
    ids = ds.random_dataset(5, 30, 7, seed=0, prompt_format="token-ids", vocab_size=5000)
    assert all(isinstance(x.prompt, list) and len(x.prompt) == 30 for x in ids)
    assert all(1000 <= t < 5000 for x in ids for t in x.prompt)
    assert ids[0].prompt == ds.random_dataset(5, 30, 7, seed=0, prompt_format="token-ids", vocab_size=5000)[0].prompt
    with pytest.raises(ValueError):
        ds.random_dataset(1, 10, 10, prompt_format="bytes")


def test_shared_prefix_dataset():
    specs = ds.shared_prefix_dataset(12, 3, prefix_len=100, suffix_len=10, output_len=5, seed=3)
    assert specs == ds.shared_prefix_dataset(12, 3, prefix_len=100, suffix_len=10, output_len=5, seed=3)
    assert [s.prompt for s in specs] != [
        s.prompt for s in ds.shared_prefix_dataset(12, 3, prefix_len=100, suffix_len=10, output_len=5, seed=4)
    ]
    by_group: dict[int, list[str]] = {}
    for s in specs:
        by_group.setdefault(s.group_id, []).append(s.prompt)
    assert sorted(by_group) == [0, 1, 2] and all(len(v) == 4 for v in by_group.values())
    prefixes = []
    for prompts in by_group.values():
        pre = os.path.commonprefix(prompts)
        assert 95 <= len(pre.split()) <= 102  # ~prefix_len tokens shared
        assert len(set(prompts)) == len(prompts)  # distinct suffixes
        assert all(8 <= len(p.split()) - 100 <= 12 for p in prompts)
        prefixes.append(pre)
    assert len(set(prefixes)) == 3
    ids = ds.shared_prefix_dataset(6, 2, prefix_len=50, suffix_len=5, output_len=5, seed=0, prompt_format="token-ids")
    g0 = [s.prompt for s in ids if s.group_id == 0]
    assert all(p[:50] == g0[0][:50] and len(p) == 55 for p in g0)


def test_agent_dataset():
    wl = ds.agent_dataset(3, 4, prefix_len=200, user_len=10, output_len=20, tool_result_len=100, seed=5)
    assert wl.num_requests == 12
    assert len({s.prefix for s in wl.sessions}) == 1  # one agent app: shared system prompt + tools
    assert 190 <= len(wl.sessions[0].prefix.split()) <= 202
    assert all(len(t.split()) == 100 for s in wl.sessions for t in s.tool_results)
    same = ds.agent_dataset(3, 4, prefix_len=200, user_len=10, output_len=20, tool_result_len=100, seed=5)
    other = ds.agent_dataset(3, 4, prefix_len=200, user_len=10, output_len=20, tool_result_len=100, seed=6)
    assert same.sessions == wl.sessions and other.sessions != wl.sessions


# ------------------------------------------------------------------ timing


def test_latency_arithmetic(server):
    n_out = 5
    res = _run(server.base_url, "m", _specs(4, n_out))
    assert res["completed"] == 4 and res["errors"] == 0
    eps = 0.005  # timer granularity
    for r in res["requests"]:
        assert r["ttft"] >= FIRST - eps, r["ttft"]  # the stub waits FIRST before the first token
        assert len(r["itl"]) == n_out - 1 and all(x >= 0 for x in r["itl"])
        # The last token arrives no earlier than the stub sends it.
        assert r["ttft"] + sum(r["itl"]) >= FIRST + (n_out - 1) * GAP - eps
        # e2e runs from the request's start to the end of its stream: after the last token.
        assert r["e2e"] >= r["ttft"] + sum(r["itl"]) - 1e-9
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / (n_out - 1))
        assert r["output_tokens"] == n_out and r["prompt_tokens"] == 10
        assert r["generated_text"].split()[0].endswith("t0")
    # The client reads usage.prompt_tokens_details.cached_tokens: the stub reports the longest
    # word prefix shared with an earlier prompt ("request" for all but the first).
    assert sorted(r["cached_tokens"] for r in res["requests"]) == [0, 1, 1, 1]
    itls = [x for r in res["requests"] for x in r["itl"]]
    assert res["mean_itl_ms"] == pytest.approx(1000 * sum(itls) / len(itls))
    tpots = sorted(r["tpot"] for r in res["requests"])
    assert res["median_tpot_ms"] == pytest.approx(1000 * (tpots[1] + tpots[2]) / 2)
    assert res["total_output_tokens"] == 4 * n_out
    assert res["output_throughput"] == pytest.approx(20 / res["duration"])
    # The request body: streaming with usage, ignore_eos, temperature.
    body = server.records[0]["body"]
    assert body["stream"] is True and body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["temperature"] == 0.0 and body["model"] == "m"


def test_multi_token_chunks_and_chat_endpoint():
    with StubServer(first_token_delay=0.1, token_delay=0.05, tokens_per_chunk=3) as s:
        res = _run(s.base_url, "m", _specs(2, 6), endpoint="chat", extra_body={"top_p": 0.5})
        assert s.records[0]["path"] == "/v1/chat/completions"
        assert s.records[0]["body"]["messages"][0]["role"] == "user"
        assert s.records[0]["body"]["top_p"] == 0.5
    for r in res["requests"]:
        assert r["success"], r["error"]
        assert r["num_chunks"] == 2 and len(r["itl"]) == 1  # a 3-token chunk = one arrival
        assert r["output_tokens"] == 6  # from usage
        assert r["tpot"] == pytest.approx((r["e2e"] - r["ttft"]) / 5)  # per token, not per chunk
        assert r["ttft"] + r["itl"][0] >= 0.1 + 0.05 - 0.005
        assert len(r["generated_text"].split()) == 6


# ------------------------------------------------------------------ load shaping


def test_concurrency_limit(server):
    res = _run(server.base_url, "m", _specs(9, 2), max_concurrency=3)
    assert res["completed"] == 9
    assert server.max_inflight == 3
    assert res["peak_concurrency"] <= 3
    assert res["duration"] >= 3 * (FIRST + GAP) - 0.05  # three waves


def test_arrival_schedule_statistics():
    t = arrival_times(3000, 20.0, seed=0)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    assert sum(gaps) / len(gaps) == pytest.approx(0.05, rel=0.08)
    assert t[:10] == arrival_times(10, 20.0, seed=0)
    assert t[:10] != arrival_times(10, 20.0, seed=1)
    assert arrival_times(5, float("inf")) == [0.0] * 5


def test_request_rate_spacing(server):
    n, rate = 12, 20.0
    res = _run(server.base_url, "m", _specs(n, 1), request_rate=rate, seed=7)
    assert res["completed"] == n
    plan = arrival_times(n, rate, seed=7)
    assert plan[-1] > 0.2  # the plan spreads the requests out (so starting all at once fails below)
    starts = [r["start_time"] for r in res["requests"]]
    for p, s in zip(plan, starts):
        assert s >= p - 0.005  # never before its planned arrival (later only if the machine is slow)
    assert len(server.records) == n


def test_num_prompts_bound(server):
    res = _run(server.base_url, "m", _specs(20, 1), request_rate=100.0, num_prompts=5)
    assert res["num_requests"] == 5 and len(server.records) == 5


def test_duration_bound_with_rate(server):
    rate, limit = 20.0, 0.5
    res = _run(server.base_url, "m", _specs(200, 1), request_rate=rate, duration=limit, seed=3)
    planned_in_time = sum(1 for t in arrival_times(200, rate, seed=3) if t < limit)
    assert planned_in_time < 50
    # Issuing stops at the limit: never a request planned after it (a slow machine issues fewer).
    assert 1 <= res["num_requests"] <= planned_in_time
    assert len(server.records) == res["num_requests"] == res["completed"]  # in-flight ones finished


def test_duration_bound_with_concurrency(server):
    # Each request takes >= 0.2 s; with 2 slots a third wave cannot start before 0.4 s > 0.3 s.
    res = _run(server.base_url, "m", _specs(20, 1), max_concurrency=2, duration=0.3)
    assert 1 <= res["num_requests"] <= 4 and res["completed"] == res["num_requests"]
    assert len(server.records) == res["num_requests"] and res["peak_concurrency"] <= 2


# ------------------------------------------------------------------ errors


def test_errors_counted(server):
    specs = _specs(4, 2)
    specs += [ds.RequestSpec(prompt=f"FAIL500 x {i}", max_tokens=2, prompt_len=3) for i in range(2)]
    specs += [ds.RequestSpec(prompt="FAIL400 y", max_tokens=2, prompt_len=2)]
    specs += [ds.RequestSpec(prompt="FAILSTREAM z", max_tokens=4, prompt_len=2)]
    res = _run(server.base_url, "m", specs)
    assert res["completed"] == 4 and res["errors"] == 4
    bad = [r for r in res["requests"] if not r["success"]]
    assert sorted(r["status_code"] for r in bad) == [200, 400, 500, 500]
    assert any("HTTP 500" in r["error"] and "stub internal error" in r["error"] for r in bad)
    assert any("HTTP 400" in r["error"] for r in bad)
    assert any("stream error" in r["error"] for r in bad)
    assert res["total_output_tokens"] == 8  # only successful requests count
    ok_ttft_ms = [r["ttft"] * 1000 for r in res["requests"] if r["success"]]
    assert len(ok_ttft_ms) == 4 and res["mean_ttft_ms"] == pytest.approx(sum(ok_ttft_ms) / 4)  # errors excluded


def test_connection_error_recorded():
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens here now
    res = _run(f"http://127.0.0.1:{port}", "m", _specs(2, 2), request_timeout=5)
    assert res["errors"] == 2 and res["completed"] == 0
    assert all("Connect" in r["error"] for r in res["requests"])
    assert res["mean_ttft_ms"] is None
    report.format_table(res)  # renders with no successful request


# ------------------------------------------------------------------ agent


def test_agent_resends_growing_history(server):
    wl = ds.agent_dataset(2, 3, prefix_len=40, user_len=5, output_len=3, tool_result_len=20,
                          think_time=0.05, seed=1)
    res = _run(server.base_url, "m", wl)
    assert res["completed"] == 6 and res["errors"] == 0
    # Join client records to server records through the stub's unique output text.
    by_rid = {rec["id"]: rec for rec in server.records}
    prompts: dict[tuple[int, int], str] = {}
    answers: dict[tuple[int, int], str] = {}
    for r in res["requests"]:
        rid = int(r["generated_text"].split()[0][1:].split("t")[0])
        prompts[(r["session_id"], r["turn"])] = by_rid[rid]["prompt"]
        answers[(r["session_id"], r["turn"])] = r["generated_text"]
        assert by_rid[rid]["path"] == "/v1/completions"
    for sess in wl.sessions:
        sid = sess.session_id
        assert prompts[(sid, 0)] == sess.prefix + sess.user_block(0)
        for k in (1, 2):
            prev, cur = prompts[(sid, k - 1)], prompts[(sid, k)]
            assert cur.startswith(prev)
            # previous prompt + the model's actual answer + tool result + new user turn
            assert cur == prev + answers[(sid, k - 1)] + sess.tool_block(k - 1) + sess.user_block(k)
    # Sessions run concurrently, turns sequentially (with think time between).
    recs = res["requests"]
    first = [r for r in recs if r["turn"] == 0]
    assert max(r["start_time"] for r in first) < min(r["start_time"] + r["e2e"] for r in first)
    for sid in (0, 1):
        rs = sorted((r for r in recs if r["session_id"] == sid), key=lambda r: r["turn"])
        for a, b in zip(rs, rs[1:]):
            assert b["start_time"] >= a["start_time"] + a["e2e"] + 0.05 - 0.01
    turns = res["per_turn"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert turns[0]["mean_prompt_tokens"] < turns[1]["mean_prompt_tokens"] < turns[2]["mean_prompt_tokens"]
    # The stub's fake prefix cache: later turns hit the previous turn's prompt.
    for t in turns[1:]:
        assert t["mean_cached_tokens"] >= turns[0]["mean_prompt_tokens"]


def test_agent_failed_turn_ends_session(server):
    wl = ds.agent_dataset(1, 3, prefix_len=10, user_len=3, output_len=2, tool_result_len=5, think_time=0.0)
    wl.sessions[0].user_messages[1] = " FAIL500"
    res = _run(server.base_url, "m", wl)
    assert [r["turn"] for r in res["requests"]] == [0, 1]
    assert res["errors"] == 1


def test_agent_tool_calls_mode_sends_the_schema_and_counts_valid_calls(server):
    wl = ds.agent_dataset(2, 2, prefix_len=10, user_len=3, output_len=4, tool_result_len=5, think_time=0.0)
    res = _run(server.base_url, "m", wl, agent_tool_calls=True)
    bodies = [rec["body"] for rec in server.records]
    assert len(bodies) == 4
    assert all(b["structured_outputs"] == {"json": ds.tool_call_schema()} for b in bodies)
    # The stub answers plain words, never a tool call: all four answers are counted, none valid.
    assert res["tool_calls"] == {"answered": 4, "valid": 0}
    assert "Valid constrained tool calls:" in report.format_table(res)
    plain = _run(server.base_url, "m", wl)
    assert "tool_calls" not in plain and "structured_outputs" not in server.records[-1]["body"]


def test_tool_call_validity_check():
    ok = '{"name": "read_file", "arguments": {"query": "src/main.py"}}'
    assert ds.is_valid_tool_call(ok)
    for bad in ('{"name": "rm_rf", "arguments": {"query": "/"}}', '{"name": "read_file"}',
                '{"name": "read_file", "arguments": {"query": 3}}', ok[:-1],
                '{"name": "read_file", "arguments": {"query": "' + "x" * 41 + '"}}',
                '{"name": "read_file", "arguments": {"query": "a", "extra": 1}}'):
        assert not ds.is_valid_tool_call(bad), bad


# ------------------------------------------------------------------ metrics / report / CLI


def test_metrics_unit():
    recs = []
    for i in range(10):
        r = RequestRecord(request_id=i, start_time=i * 0.1, success=True, ttft=0.1 * (i + 1),
                          itl=[0.01, 0.03], e2e=0.1 * (i + 1) + 0.04, output_tokens=3, prompt_tokens=10,
                          cached_tokens=5)
        r.tpot = (r.e2e - r.ttft) / 2
        recs.append(r)
    recs.append(RequestRecord(request_id=10, success=False, error="HTTP 500", e2e=0.01))
    m = compute_metrics(recs, duration=2.0)
    assert m["completed"] == 10 and m["errors"] == 1
    assert m["mean_ttft_ms"] == pytest.approx(550.0)
    assert m["median_ttft_ms"] == pytest.approx(550.0)
    assert m["p90_ttft_ms"] == pytest.approx(910.0)
    assert m["p99_ttft_ms"] == pytest.approx(991.0)
    assert m["mean_itl_ms"] == pytest.approx(20.0)
    assert m["mean_tpot_ms"] == pytest.approx(20.0)
    assert m["request_throughput"] == pytest.approx(5.0)
    assert m["output_throughput"] == pytest.approx(15.0)
    assert m["total_token_throughput"] == pytest.approx(65.0)
    assert m["prefix_cache_hit_rate"] == pytest.approx(0.5)
    a = RequestRecord(request_id=0, start_time=0.0, e2e=1.0)
    b = RequestRecord(request_id=1, start_time=0.5, e2e=1.0)
    c = RequestRecord(request_id=2, start_time=1.0, e2e=1.0)
    assert peak_concurrency([a, b, c]) == 2


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_args(p)
    return p.parse_args(argv)


def test_main_serve_end_to_end(fast_stub, tmp_path, capsys):
    fast_stub.reset()
    common = ["--base-url", fast_stub.base_url, "--model", "stub", "--disable-tqdm", "--seed", "1"]
    res = main_serve(_args(common + [
        "--dataset", "agent", "--sessions", "2", "--turns", "3", "--prefix-len", "30",
        "--user-len", "4", "--output-len", "3", "--tool-result-len", "10", "--think-time", "0.01",
        "--result-dir", str(tmp_path), "--result-file", "agent.json", "--label", "stub",
    ]))
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Agent turns" in out
    assert res["completed"] == 6 and res["dataset"] == "agent"
    saved = json.loads((tmp_path / "agent.json").read_text())
    assert saved["completed"] == 6 and len(saved["requests"]) == 6 and saved["request_rate"] == "inf"
    assert saved["dataset_args"]["turns"] == 3 and len(saved["per_turn"]) == 3
    assert (tmp_path / "agent_latency.png").stat().st_size > 1000
    assert (tmp_path / "agent_agent_turns.png").stat().st_size > 1000

    paths = []
    for c in (1, 4):
        fast_stub.reset()
        main_serve(_args(common + [
            "--dataset", "random", "--num-prompts", "8", "--input-len", "20", "--output-len", "4",
            "--prompt-format", "token-ids", "--max-concurrency", str(c), "--no-plot",
            "--result-dir", str(tmp_path), "--result-file", f"rand-c{c}.json", "--label", "rand",
            "--extra-body", '{"top_k": 5}',
        ]))
        body = fast_stub.records[0]["body"]
        assert isinstance(body["prompt"], list) and len(body["prompt"]) == 20 and body["top_k"] == 5
        assert fast_stub.max_inflight <= c
        paths.append(str(tmp_path / f"rand-c{c}.json"))
    assert not (tmp_path / "rand-c1_latency.png").exists()
    out_png = report.plot_throughput_vs_concurrency(paths, str(tmp_path / "tvc.png"))
    assert os.path.getsize(out_png) > 1000

    with pytest.raises(SystemExit):
        main_serve(_args(common + ["--prompt-format", "token-ids", "--endpoint", "chat"]))
