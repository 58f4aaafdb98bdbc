"""Data parallelism behind one API server (``tinyvllm serve --data-parallel-size 2``, issue 38).

The router and the per-replica config are checked in-process; then one real DP=2 server (module-scoped: two
engine-core processes behind one API process) serves chat, completion and streaming with the greedy outputs of
the session's shared DP=1 server (same model and flags), puts two requests that share a long prefix on the same
replica (the prefix-cache hit shows in that replica's own stats) and frees a disconnected stream's blocks on
its replica. A server whose replica is killed answers 503 and exits (slow tier: a server of its own, since the
test order is random and the kill ends the server).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest

from tinyvllm.config import EngineConfig
from tinyvllm.engine.data_parallel import DPRouter, check_data_parallel, replica_config, sum_stats
from tinyvllm.metrics.stats import SchedulerStats

# ----------------------------------------------------------------------------- in process


def test_router_keeps_a_prefix_on_its_replica_and_spreads_new_prompts():
    r = DPRouter(2, 16, [1000, 1000])
    r.prefill_weight = 16.0

    def done(rid: str) -> None:  # the request's first output, then its finish
        r.prefill_done(rid)
        r.finish(rid)

    a, b = list(range(100, 420)), list(range(5000, 5320))  # 20 blocks each, nothing shared
    first = r.route("a1", a)
    assert r.route("b1", b) != first  # an idle replica beats a busy one when nothing is cached
    done("a1")
    done("b1")
    for k in range(4):  # each conversation comes back to the replica that holds it
        assert r.route(f"a{k + 2}", a + [7] * (k + 1)) == first
        assert r.route(f"b{k + 2}", b + [9] * (k + 1)) != first
        done(f"a{k + 2}")
        done(f"b{k + 2}")
    assert r.state(first)["predicted_hit_blocks"] == 4 * 20  # whole blocks (321+ tokens: 20 of 21 reusable)
    # a prompt routed but not yet prefilled predicts nothing: a second one like it goes by load
    r.route("c1", list(range(9000, 9320)))
    assert r.route("c2", list(range(9000, 9320)) + [1]) != r.replica_of("c1")
    done("c1")
    done("c2")
    # a replica busier by more than the prefix is worth (16 x 20 blocks) is passed over
    for k in range(17):
        r.route(f"busy{k}", list(range(10_000 * (k + 1), 10_000 * (k + 1) + 320)), pinned=first)
    assert r.route("a-late", a + [1]) != first
    assert r.requests.keys() == {f"busy{k}" for k in range(17)} | {"a-late"}
    r.finish("a-late")  # aborted before any output: its blocks are not predicted anywhere
    assert r._match(r.replicas[1 - first], r.block_hashes(a)) == 0


def test_round_robin_alternates_and_salts_split_the_prefix():
    r = DPRouter(2, 16, [100, 100], policy="round-robin")
    assert [r.route(str(i), [1] * 40) for i in range(4)] == [0, 1, 0, 1]
    p = DPRouter(2, 16, [100, 100])
    x = p.route("x", list(range(64)), cache_salt="alice")
    p.prefill_done("x")
    p.finish("x")
    assert p._match(p.replicas[x], p.block_hashes(list(range(64)), "bob")) == 0
    assert p._match(p.replicas[x], p.block_hashes(list(range(64)), "alice")) == 4


def test_replica_configs_and_refusals(tmp_path):
    c = EngineConfig.from_kwargs(data_parallel_size=2, kv_offload_size="1MiB", kv_offload_path=str(tmp_path),
                                 kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq", '
                                                  '"endpoint": "tcp://*:5557"}')
    r0, r1 = replica_config(c, 0), replica_config(c, 1)
    assert (r0.cache_config.kv_offload_path, r1.cache_config.kv_offload_path) == (str(tmp_path / "dp0"),
                                                                                  str(tmp_path / "dp1"))
    assert (r0.cache_config.kv_events_config.endpoint, r1.cache_config.kv_events_config.endpoint) == (
        "tcp://*:5557", "tcp://*:5558")  # vLLM's port offset per DP rank
    assert r1.parallel_config.data_parallel_rank == 1
    with pytest.raises(ValueError, match="prefill/decode"):
        check_data_parallel(EngineConfig.from_kwargs(
            data_parallel_size=2, kv_transfer_config='{"kv_connector": "ZmqConnector", "kv_role": "kv_both"}'))
    with pytest.raises(ValueError, match="tensor-parallel-size > 1 is not supported"):
        check_data_parallel(EngineConfig.from_kwargs(data_parallel_size=2, tensor_parallel_size=2))
    with pytest.raises(ValueError, match="one core per replica"):
        check_data_parallel(EngineConfig.from_kwargs(data_parallel_size=(os.cpu_count() or 1) + 1))
    s = sum_stats([SchedulerStats(num_running=1, kv_blocks_total=10, prefix_cache_miss_reasons={"cold": 1},
                                  spec_decode_num_accepted_tokens_per_pos=[1, 2], kv_offload_block_bytes=64),
                   SchedulerStats(num_running=2, kv_blocks_total=10, prefix_cache_miss_reasons={"cold": 2},
                                  spec_decode_num_accepted_tokens_per_pos=[3], kv_offload_block_bytes=64)])
    assert (s.num_running, s.kv_blocks_total, s.prefix_cache_miss_reasons, s.spec_decode_num_accepted_tokens_per_pos,
            s.kv_offload_block_bytes) == (3, 20, {"cold": 3}, [4, 2], 64)


def test_serve_refuses_dp_with_tp_in_one_line():
    r = subprocess.run([sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--port", "0", "-dp", "2",
                        "-tp", "2"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    out = r.stdout + r.stderr
    errors = [ln for ln in out.splitlines() if " ERROR " in ln]
    assert r.returncode == 2 and "Traceback" not in out and len(errors) == 1, out[-3000:]
    assert "--data-parallel-size > 1 with --tensor-parallel-size > 1 is not supported" in errors[0]


# ----------------------------------------------------------------------------- one real DP=2 server


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    from server_utils import SHARED_SERVER_ARGS, running_server

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPU cores (one per replica)")
    yield from running_server(tmp_path_factory.mktemp("dp_server") / "server.log", [*SHARED_SERVER_ARGS, "-dp", "2"])


def _post(srv, path: str, body: dict) -> dict:
    r = httpx.post(srv.base + path, json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _stream_text(srv, path: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", srv.base + path, json={**body, "stream": True}, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for c in json.loads(line[6:])["choices"]:
                text += c.get("text") or (c.get("delta") or {}).get("content") or ""
    return text


def _replicas(srv) -> list[dict]:
    return httpx.get(srv.base + "/debug/stats", timeout=10).json()["replicas"]


def test_dp2_outputs_equal_dp1_chat_completion_streaming(dp_server, shared_server):
    chat = {"model": "SmolLM2-135M-Instruct", "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 16, "temperature": 0}
    comp = {"model": "SmolLM2-135M-Instruct", "prompt": "The capital of France is", "max_tokens": 12,
            "temperature": 0}
    for srv_name, srv in (("dp1", shared_server), ("dp2", dp_server)):
        got = (_post(srv, "/v1/chat/completions", chat)["choices"][0]["message"]["content"],
               _post(srv, "/v1/completions", comp)["choices"][0]["text"],
               _stream_text(srv, "/v1/chat/completions", chat), _stream_text(srv, "/v1/completions", comp))
        if srv_name == "dp1":
            want = got
    assert got == want and got[0] == got[2] and got[1] == got[3], (got, want)
    health = httpx.get(dp_server.base + "/health", timeout=10).json()
    assert len(set(health["engine_core_pids"])) == 2
    metrics = httpx.get(dp_server.base + "/metrics", timeout=10).text
    assert 'tinyvllm:kv_cache_total_blocks{engine="1",model_name="SmolLM2-135M-Instruct"}' in metrics


def test_a_shared_long_prefix_lands_on_one_replica_and_hits_its_cache(dp_server):
    salt = uuid.uuid4().hex  # nothing cached anywhere yet
    prefix = f"{salt} " + " ".join(f"word{i}" for i in range(80))
    before = _replicas(dp_server)
    for tail in ("apple", "banana"):
        _post(dp_server, "/v1/completions", {"model": "SmolLM2-135M-Instruct", "prompt": prefix + " " + tail,
                                             "max_tokens": 2, "temperature": 0})
    after = _replicas(dp_server)
    routed = [a["routed_requests"] - b["routed_requests"] for a, b in zip(after, before)]
    assert sorted(routed) == [0, 2], routed
    i = routed.index(2)
    hits = after[i]["prefix_cache_hits"] - before[i]["prefix_cache_hits"]
    # The second request found the first one's blocks on that replica: every full block of the prompts' common
    # token prefix (the salt's length in tokens varies, so the bound is derived from the tokenization).
    ids = [httpx.post(dp_server.base + "/tokenize", json={"prompt": prefix + " " + t}, timeout=10).json()["tokens"]
           for t in ("apple", "banana")]
    common = next(n for n, (a, b) in enumerate(zip(ids[0] + [None], ids[1] + [-1])) if a != b)
    assert hits == min(common, len(ids[1]) - 1) // 16 * 16 >= 240, (hits, common)
    assert after[1 - i]["prefix_cache_queries"] == before[1 - i]["prefix_cache_queries"]


def test_x_data_parallel_rank_header_pins_the_replica(dp_server):
    """vLLM's X-data-parallel-rank: the request goes to that replica; a bad value is a 400."""
    before = _replicas(dp_server)
    for path, body in (("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})):
        r = httpx.post(dp_server.base + path, json=body, headers={"X-data-parallel-rank": "1"}, timeout=60)
        assert r.status_code == 200, r.text
    after = _replicas(dp_server)
    assert [a["routed_requests"] - b["routed_requests"] for a, b in zip(after, before)] == [0, 2]
    for bad in ("2", "one"):
        r = httpx.post(dp_server.base + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1},
                       headers={"X-data-parallel-rank": bad}, timeout=60)
        assert r.status_code == 400 and "data_parallel_rank" in r.text.replace("-", "_").lower(), r.text


def test_disconnect_frees_blocks_on_its_replica(dp_server):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": f"{uuid.uuid4().hex} Count slowly:", "max_tokens": 400,
            "temperature": 0, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=120) as c:
        with c.stream("POST", dp_server.base + "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: a collected iterator closes the connection
            seen = [line for line, _ in zip((ln for ln in lines if ln.startswith("data: ")), range(2))]
            assert all('"text"' in line for line in seen), seen
            busy = dp_server.state()
            assert busy["api_routed_requests"] == 1 and busy["api_streams"] == 1, busy
            held = [busy[f"replica{i}_core_kv_blocks_used"] for i in (0, 1)]
            assert sorted(held)[0] == 0 and sorted(held)[1] >= 1, busy  # on one replica only
        # leaving the block closes the connection mid-stream
    st = dp_server.wait_idle()
    assert not any(st.values()), st  # replica<i>_core_kv_blocks_used / _running / _waiting included


@pytest.mark.slow
def test_killing_one_replica_gives_503_and_exit(tmp_path):
    """SIGKILL of replica 1's engine core: requests get 503 (or a refused connection), the API process exits
    non-zero and replica 0 goes down with it (fail-fast, as when the single core dies)."""
    from server_utils import Server, pid_alive, statuses_until_exit

    srv = Server(tmp_path / "dp_kill.log", ["--max-model-len", "512", "-dp", "2"])
    pids: list[int] = []
    try:
        srv.wait_healthy()
        pids = httpx.get(srv.base + "/health", timeout=10).json()["engine_core_pids"]
        _post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        os.kill(pids[1], signal.SIGKILL)
        statuses = statuses_until_exit(srv, 30, 0.05)
        assert srv.proc.wait(30) != 0
        assert 503 in statuses or statuses[-1:] == ["refused"], statuses
        assert "data-parallel replica 1" in srv.log_tail(20000), srv.log_tail()
        deadline = time.monotonic() + 10
        while pid_alive(pids[0]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not pid_alive(pids[0])  # the surviving replica went down with the server
    finally:
        srv.stop()
        for pid in pids:
            if pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
