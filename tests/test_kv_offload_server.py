"""A real server with a disk KV offload tier (``--kv-offload-path``), killed with SIGKILL and started
again: the session's turn 2 computes only its new tokens (``usage.prompt_tokens_details.cached_tokens``),
cache_salt isolates sessions over HTTP, an empty salt is a 400 naming the field, and the Prometheus
``kv_offload`` counters move."""

from __future__ import annotations

import os
import re
import signal
import subprocess

import httpx
import openai
import pytest

from server_utils import MODEL, Server, pid_alive

BS = 16


def _start(tmp_path, name, offload_dir):
    srv = Server(tmp_path / f"{name}.log", ["--max-model-len", "1024", "--kv-cache-memory", "64MiB",
                                            "--kv-offload-size", "32MiB", "--kv-offload-path", str(offload_dir)])
    try:
        return srv.wait_healthy()
    except RuntimeError as e:
        srv.stop()
        pytest.fail(str(e))


def _kill(srv):
    for pid in (srv.proc.pid, srv.core_pid):
        if pid and pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
    srv.proc.wait(10)


def _client(srv):
    return openai.OpenAI(base_url=srv.base + "/v1", api_key="none", max_retries=0, timeout=300)


def test_session_resumes_from_disk_after_sigkill_restart(tmp_path):
    offload = tmp_path / "kv"
    turn1 = [{"role": "user", "content": "Name three rivers in Europe and say one thing about each of them."}]
    a = _start(tmp_path, "a", offload)
    try:
        c = _client(a)
        r1 = c.chat.completions.create(model=MODEL, messages=turn1, max_tokens=24, temperature=0,
                                       extra_body={"cache_salt": "session-1"})
        assert r1.usage.prompt_tokens_details.cached_tokens == 0
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model=MODEL, messages=turn1, max_tokens=2, extra_body={"cache_salt": ""})
        assert e.value.body["param"] == "cache_salt"
        c.completions.create(model=MODEL, prompt="warm the pool", max_tokens=2,
                             extra_body={"cache_salt": "other"})  # the salt is accepted by completions too
    finally:
        _kill(a)  # no shutdown path runs: what is on disk is what the finished request left there
    b = _start(tmp_path, "b", offload)
    try:
        assert "from a previous run" in b.log_tail(20000)
        c = _client(b)
        turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                         {"role": "user", "content": "Which one is the longest?"}]
        r2 = c.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0,
                                       extra_body={"cache_salt": "session-1"})
        p1 = r1.usage.prompt_tokens
        cached = r2.usage.prompt_tokens_details.cached_tokens
        # Every full block of turn 1's prompt comes from the disk tier: only the new tokens (the answer
        # as re-templated, the new message, and at most one partial block) are computed.
        assert cached >= p1 // BS * BS
        # A fresh pool after the restart: all of them came from the tier (the extension field says so).
        assert getattr(r2.usage.prompt_tokens_details, "cached_tokens_tier", None) == cached
        assert not hasattr(r1.usage.prompt_tokens_details, "cached_tokens_tier")  # no tier hit, no field
        assert r2.usage.prompt_tokens - cached < r2.usage.prompt_tokens - p1 + BS
        other = c.chat.completions.create(model=MODEL, messages=turn2, max_tokens=8, temperature=0,
                                          extra_body={"cache_salt": "session-2"})
        assert other.usage.prompt_tokens_details.cached_tokens == 0  # another salt shares nothing
        assert other.choices[0].message.content == r2.choices[0].message.content
        metrics = httpx.get(b.base + "/metrics", timeout=10).text
        hits = float(re.search(r"^tinyvllm:kv_offload_hit_tokens_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))
        assert hits >= p1 // BS * BS
    finally:
        b.proc.send_signal(signal.SIGTERM)
        try:
            b.proc.wait(20)
        except subprocess.TimeoutExpired:
            pass
        _kill(b)
