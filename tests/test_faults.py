"""Faults under load: SIGTERM or SIGINT while streams are open, ``kill -9`` of the engine core process, and
``kill -9`` of the API process (parent death). Each test has a server of its own.

SIGTERM to the API process, or SIGINT to the server's process group (a terminal's Ctrl-C, which the engine
core ignores): every open stream ends with an error event then ``data: [DONE]``, both processes exit (code
0), no orphan, no traceback in the log.
kill -9 of the core: open streams end (never hang), new requests get 503 (or the connection is refused once
the API process is gone), and the API process exits with a non-zero code.
kill -9 of the API process: the engine core (its child) notices (``PR_SET_PDEATHSIG``, else a ``getppid``
check) and exits.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import pytest

from server_utils import Server, pid_alive


def _start(tmp_path_factory, name: str, new_session: bool = False) -> Server:
    return Server(tmp_path_factory.mktemp(name) / "server.log",
                  ["--max-model-len", "512", "--max-num-seqs", "8", "--kv-cache-memory", "64MiB"],
                  new_session=new_session).wait_healthy()


def _open_streams(srv: Server, n: int) -> tuple[list[threading.Thread], list[dict], threading.Barrier]:
    """``n`` streaming completions that would run long; returns their threads, their records, and a barrier
    passed once every stream has received its first token chunk."""
    records = [{"events": [], "done": False, "exc": None} for _ in range(n)]
    started = threading.Barrier(n + 1)

    def run(rec: dict) -> None:
        first = True
        try:
            with httpx.stream("POST", srv.base + "/v1/completions", timeout=120,
                              json={"prompt": "Count slowly from one to a thousand:", "max_tokens": 400,
                                    "ignore_eos": True, "stream": True}) as r:
                for line in r.iter_lines():
                    if line == "data: [DONE]":
                        rec["done"] = True
                    elif line.startswith("data: "):
                        rec["events"].append(json.loads(line[6:]))
                        if first:
                            first = False
                            started.wait(60)
        except Exception as e:  # noqa: BLE001 - recorded for the assertions
            rec["exc"] = e
        finally:
            if first:
                started.abort()

    threads = [threading.Thread(target=run, args=(rec,), daemon=True) for rec in records]
    for t in threads:
        t.start()
    return threads, records, started


@pytest.mark.parametrize("how", ["sigterm", "sigint-group"])
def test_signal_mid_load_ends_every_stream_and_exits(tmp_path_factory, how):
    srv = _start(tmp_path_factory, how, new_session=how == "sigint-group")
    try:
        threads, records, started = _open_streams(srv, 6 if how == "sigterm" else 3)
        started.wait(120)
        core = srv.core_pid
        t0 = time.monotonic()
        if how == "sigterm":
            srv.proc.send_signal(signal.SIGTERM)
        else:  # Ctrl-C in a terminal: SIGINT to every process of the foreground group
            os.killpg(srv.proc.pid, signal.SIGINT)
        for t in threads:
            t.join(60)
        code = srv.proc.wait(60)
        api_exit = time.monotonic() - t0
        while pid_alive(core) and time.monotonic() - t0 < 60:
            time.sleep(0.05)
        core_exit = time.monotonic() - t0
        print(f"{how} -> API process exited after {api_exit:.2f}s, engine core gone after {core_exit:.2f}s")
        for rec in records:
            assert rec["exc"] is None, rec["exc"]
            assert rec["done"], "stream did not end with [DONE]"
            assert "error" in rec["events"][-1], rec["events"][-1]
            assert rec["events"][-1]["error"]["code"] == 503
        assert code == 0, srv.log_tail()
        assert not pid_alive(core), "engine core orphaned"
        log = srv.log_tail(200_000)
        assert "Traceback" not in log and "received signal" in log, log
    finally:
        srv.stop()


def test_kill9_engine_core_gives_503_and_the_server_exits(tmp_path_factory):
    srv = _start(tmp_path_factory, "kill9")
    try:
        threads, records, started = _open_streams(srv, 3)
        started.wait(120)
        t0 = time.monotonic()
        os.kill(srv.core_pid, signal.SIGKILL)
        statuses = []  # from the kill until the API process is gone: /health and new requests
        while srv.proc.poll() is None and time.monotonic() - t0 < 60:
            try:
                statuses.append(httpx.get(srv.base + "/health", timeout=10).status_code)
                r = httpx.post(srv.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
                statuses.append(r.status_code)
            except httpx.HTTPError:
                statuses.append("refused")
        code = srv.proc.wait(60)
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a stream hangs after the engine core died"
        for rec in records:  # each stream ended: an error event + [DONE], or the connection closed
            assert rec["done"] or rec["exc"] is not None
            if rec["done"]:
                assert "error" in rec["events"][-1]
        print(f"kill -9 core -> API process exited after {time.monotonic() - t0:.2f}s; answers {set(statuses)}")
        assert code != 0
        # The API process learns of the death within its next poll: until then /health may still say 200;
        # from the first 503 on, never a 200 again (every request refused or 503 until the process exits).
        first_bad = next(i for i, s in enumerate(statuses) if s != 200)
        assert first_bad <= 1, statuses  # at most the first /health, sent before the API could know
        assert 503 in statuses and all(s in (503, "refused") for s in statuses[first_bad:]), statuses
    finally:
        srv.stop()


def test_kill9_api_process_the_engine_core_exits(tmp_path_factory):
    srv = _start(tmp_path_factory, "parentdeath")
    try:
        threads, records, started = _open_streams(srv, 2)  # the core is busy decoding when its parent dies
        started.wait(120)
        core = srv.core_pid
        assert pid_alive(core)
        t0 = time.monotonic()
        srv.proc.kill()
        srv.proc.wait(30)
        while pid_alive(core) and time.monotonic() - t0 < 120:  # generous: only "it exits" is asserted
            time.sleep(0.05)
        print(f"kill -9 API process -> engine core gone after {time.monotonic() - t0:.2f}s")
        assert not pid_alive(core), "the engine core outlived its parent"
        for t in threads:
            t.join(60)
            assert not t.is_alive(), "a stream hangs after the API process died"
        assert all(rec["exc"] is not None or not rec["done"] for rec in records)  # cut, never a clean [DONE]
        assert "engine core process exiting" in srv.log_tail(200_000)
    finally:
        srv.stop()
