"""The ``generate`` and ``chat`` commands' happy paths, run as a user runs them: ``generate`` as a subprocess,
``chat`` in a real pseudo-terminal (python's :mod:`pty`), typing a message and reading the streamed answer.
Both are greedy, so their text must equal the offline ``LLM`` on the same prompt."""

from __future__ import annotations

import os
import pty
import select
import subprocess
import sys
import time

from tinyvllm import SamplingParams

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 12
CLI = [sys.executable, "-m", "tinyvllm.entrypoints.cli"]
ENV = dict(os.environ, TOKENIZERS_PARALLELISM="false")


GENERATE_PROMPT = "The three primary colors are"
GENERATE = [*CLI, "generate", GENERATE_PROMPT, "--model", MODEL, "--dtype", "bfloat16", "--max-tokens", str(MAX_TOKENS)]
CHAT = [*CLI, "chat", "--model", MODEL, "--dtype", "bfloat16", "--max-tokens", str(MAX_TOKENS)]
# Started at collection when their test is selected (tests/conftest.py, which lowers them to nice 19): the
# commands load the model (~3 s each) while other tests run, and their tests read them from where they are.
_STARTED: dict[str, object] = {}


def _generate() -> subprocess.Popen:
    return subprocess.Popen(GENERATE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)


def _start_test_generate_prints_the_llm_greedy_text_in_background(tmp) -> list[subprocess.Popen]:  # noqa: ARG001
    _STARTED["generate"] = _generate()
    return [_STARTED["generate"]]


def _start_test_chat_in_a_terminal_in_background(tmp) -> list[subprocess.Popen]:  # noqa: ARG001
    _STARTED["chat"] = _Pty(CHAT)
    return [_STARTED["chat"].proc]


def test_generate_prints_the_llm_greedy_text(smol_llm):
    want = smol_llm.generate(GENERATE_PROMPT, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    proc = _STARTED.pop("generate", None) or _generate()
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    assert out == want + "\n"


class _Pty:
    """A child process whose stdin, stdout and stderr are a pseudo-terminal, as in a terminal window (Python's
    ``input()`` writes its prompt to stderr when no ``readline`` is loaded)."""

    def __init__(self, cmd: list[str]) -> None:
        self.master, slave = pty.openpty()
        self.proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, env=ENV, close_fds=True)
        os.close(slave)
        self.seen = b""

    def read_until(self, marker: bytes, timeout: float = 600) -> bytes:
        """Everything the terminal showed until ``marker`` (consumed), or fail after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while marker not in self.seen:
            assert time.monotonic() < deadline, f"no {marker!r} on the terminal; it shows {self.seen[-2000:]!r}"
            assert self.proc.poll() is None or select.select([self.master], [], [], 0)[0], \
                f"exited with {self.proc.returncode}; terminal: {self.seen[-2000:]!r}"
            if select.select([self.master], [], [], 0.2)[0]:
                try:
                    self.seen += os.read(self.master, 4096)
                except OSError:  # EIO: the child closed the terminal
                    break
        before, _, self.seen = self.seen.partition(marker)
        return before

    def type(self, text: str) -> None:
        os.write(self.master, text.encode())


def test_chat_in_a_terminal(smol_llm):
    question = "What is the capital of France?"
    want = smol_llm.chat([{"role": "user", "content": question}],
                         SamplingParams(temperature=0, max_tokens=MAX_TOKENS))[0].outputs[0].text
    term = _STARTED.pop("chat", None) or _Pty(CHAT)
    try:
        banner = term.read_until(b"> ").decode()  # the load's log lines, the banner, then the prompt
        assert banner.endswith("\r\n") and "tinyvllm chat with " + MODEL in banner, banner
        term.type(question + "\n")
        shown = term.read_until(b"> ").decode()  # the echo of the typed line, then the streamed answer
        lines = shown.replace("\r\n", "\n").split("\n")
        assert lines[0] == question  # the terminal echoed what was typed
        assert "\n".join(lines[1:]) == want + "\n"
        assert want.strip()  # (what the model answers is bf16's near-tie call: see test_chat_and_generate_text)
        term.type("\n")  # an empty line quits
        assert term.proc.wait(120) == 0
    finally:
        if term.proc.poll() is None:
            term.proc.kill()
            term.proc.wait(10)
        os.close(term.master)
