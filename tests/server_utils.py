"""Start and stop a real ``tinyvllm serve`` process (API process + EngineCore process) for the hardening, fuzz,
soak and fault tests; read its tracked-state endpoint and its processes' RSS."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

MODEL = "SmolLM2-135M-Instruct"
START_TIMEOUT_S = 240


def bound_socket() -> socket.socket:
    """A listening-ready TCP socket on 127.0.0.1 bound to a port the kernel chose (port 0): hand it to the
    server that uses it (``uvicorn.Server.run(sockets=[sock])``), so no other process can take the port
    between choosing and binding it."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return sock


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie still answers kill(0); treat it as gone
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def statuses_until_exit(srv: "Server", timeout: float, interval: float) -> list:
    """POST a 2-token completion every ``interval`` s until the server process exits (or ``timeout`` s):
    the status codes seen, "refused" where the connection failed. For tests that kill part of an engine."""
    t0, statuses = time.monotonic(), []
    while srv.proc.poll() is None and time.monotonic() - t0 < timeout:
        try:
            statuses.append(httpx.post(srv.base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                       timeout=10).status_code)
        except httpx.HTTPError:
            statuses.append("refused")
        time.sleep(interval)
    return statuses


def rss_bytes(pid: int) -> int:
    """Resident set size of ``pid`` (bytes), from /proc."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class Server:
    """A ``tinyvllm serve`` subprocess; ``core_pid`` once healthy.

    The server binds port 0 itself and writes the port it got to ``--port-file``: :attr:`port` reads it
    (no bind-then-close race with other processes)."""

    def __init__(self, log_path: Path, extra_args: list[str], env: dict[str, str] | None = None,
                 headers: dict[str, str] | None = None, new_session: bool = False) -> None:
        self.port_file = log_path.with_name(log_path.name + ".port")
        self.port_file.unlink(missing_ok=True)
        self._port: int | None = None
        self.log_path = log_path
        self.headers = headers or {}
        cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--model", MODEL, "--dtype", "bfloat16",
               "--port", "0", "--port-file", str(self.port_file), *extra_args]
        full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", **(env or {}))
        with open(log_path, "wb") as log:
            # new_session: its own process group, as a terminal's foreground job (a Ctrl-C goes to the group)
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=full_env,
                                         start_new_session=new_session)
        self.core_pid: int | None = None

    @property
    def port(self) -> int:
        """The port the server listens on (read from its port file; ``FileNotFoundError`` before it bound)."""
        if self._port is None:
            self._port = int(self.port_file.read_text())
        return self._port

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> "Server":
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if not self.port_file.exists():  # not listening yet (the port file is written once bound)
                    raise httpx.ConnectError("no port yet")
                r = httpx.get(self.base + "/health", timeout=2)
                if r.status_code == 200:
                    self.core_pid = r.json()["engine_core_pid"]
                    return self
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"server not healthy after {timeout}s:\n{self.log_tail()}")
            time.sleep(0.1)

    def state(self) -> dict[str, int]:
        r = httpx.get(self.base + "/debug/state", headers=self.headers, timeout=10)
        r.raise_for_status()
        return r.json()

    def wait_idle(self, timeout: float = 30.0) -> dict[str, int]:
        """Poll ``/debug/state`` until everything tracked is zero (or ``timeout``); returns the last state."""
        deadline = time.monotonic() + timeout
        while True:
            st = self.state()
            if not any(st.values()) or time.monotonic() > deadline:
                return st
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        if self.core_pid and pid_alive(self.core_pid):
            os.kill(self.core_pid, signal.SIGKILL)


# The session's shared server (the ``shared_server`` fixture of tests/conftest.py): one ``tinyvllm serve``
# for every module whose tests leave nothing behind that another test could see (test_server,
# test_hardening, test_dashboard, test_structured_output, test_messages_api), started once instead of once
# per module. Tests on it must not depend on a fresh server: they compare counters before and after, salt
# or vary their prompts where a prefix-cache hit would change what they check, and wait until idle after
# an abort. A test that needs other flags, or kills or restarts its server, starts one of its own.
SHARED_MAX_MODEL_LEN = 1024
SHARED_MAX_NUM_SEQS = 16
SHARED_MAX_WAITING = 20
SHARED_BODY_CAP = 8_000_000
SHARED_SERVER_ARGS = ["--max-model-len", str(SHARED_MAX_MODEL_LEN), "--max-num-seqs", str(SHARED_MAX_NUM_SEQS),
                      "--max-waiting-requests", str(SHARED_MAX_WAITING), "--kv-cache-memory", "256MiB",
                      "--max-request-body-bytes", str(SHARED_BODY_CAP), "--tool-call-parser", "hermes"]

# A server with the Hermes tool-call parser (structured outputs, tools, the Messages API tests): the shared
# server's flags, so a module that starts its own with these could use ``shared_server`` instead.
TOOL_SERVER_ARGS = SHARED_SERVER_ARGS


# The session's keyed server (``keyed_server`` in tests/conftest.py): the shared server's flags plus two API keys,
# a Responses store bounded to a few responses, and the qwen3 reasoning parser (SmolLM2 never writes <think> by
# itself). test_responses_api's server; test_messages_api checks ``--api-key`` on it too.
KEYED_SERVER_KEYS = ("key-a", "key-b")
KEYED_MAX_STORED = 6


def keyed_server_args(store_path: Path) -> list[str]:
    return [*SHARED_SERVER_ARGS, "--api-key", *KEYED_SERVER_KEYS, "--responses-store-path", str(store_path),
            "--responses-store-max-count", str(KEYED_MAX_STORED), "--reasoning-parser", "qwen3"]


def running_server(log: Path, args: list[str]):
    """Generator for a module fixture: a started, healthy ``Server`` (a start failure fails the test with
    its reason), stopped afterwards. Use as ``yield from running_server(...)``."""
    import pytest

    srv = Server(log, args)
    try:
        srv.wait_healthy()
    except RuntimeError as e:
        srv.stop()
        pytest.fail(str(e))
    try:
        yield srv
    finally:
        srv.stop()
