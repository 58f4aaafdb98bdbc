"""The ``tinyvllm`` command line: what building and parsing it imports, and how a bad start-up option is
reported (one line naming the flag, a non-zero exit code, no traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


def _run(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True)


def test_serve_parser_imports_no_benchmarks_nor_server():
    _run("import sys\n"
         "from tinyvllm.entrypoints import cli\n"
         "args = cli.build_parser(['serve', '--port', '1234']).parse_args(['serve', '--port', '1234'])\n"
         "assert args.func is cli.cmd_serve and args.port == 1234\n"
         "bad = sorted(m for m in sys.modules if m.startswith(('tinyvllm.benchmarks', 'fastapi', 'uvicorn',\n"
         "             'tinyvllm.entrypoints.openai.api_server')))\n"
         "assert not bad, bad\n")


def test_bench_parser_is_built_when_bench_is_the_command():
    from tinyvllm.entrypoints import cli

    argv = ["bench", "throughput", "--num-prompts", "3", "--block-size", "8"]
    args = cli.build_parser(argv).parse_args(argv)
    assert args.bench_command == "throughput" and args.num_prompts == 3 and args.block_size == 8


def test_api_server_does_not_import_the_cli():
    _run("import sys\n"
         "import tinyvllm.entrypoints.openai.api_server\n"
         "assert 'tinyvllm.entrypoints.cli' not in sys.modules\n")


# ----------------------------------------------------------------------------- start-up errors (issue 41)

CLI = [sys.executable, "-m", "tinyvllm.entrypoints.cli"]


def _one_error_line(cmd: list[str], code: int, timeout: float = 120) -> str:
    """Run ``tinyvllm ...``: it exits with ``code``, prints no traceback, and exactly one error line, which
    is returned."""
    r = subprocess.run([*CLI, *cmd], capture_output=True, text=True, timeout=timeout,
                       env=dict(os.environ, TOKENIZERS_PARALLELISM="false"))
    out = r.stdout + r.stderr
    assert r.returncode == code, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [ln for ln in out.splitlines() if " ERROR " in ln or ln.startswith("error:")]
    assert len(errors) == 1, out[-3000:]
    return errors[0]


def _bad_serve_options(tmp: Path) -> list[tuple[list[str], str]]:
    a_file = tmp / "a_file"
    a_file.write_text("x")
    return [
        (["--kv-offload-size", "32MiB", "--kv-offload-path", str(a_file)],
         "--kv-offload-path '%s' is a file, not a directory" % a_file),
        (["--kv-offload-size", "32MiB", "--kv-offload-path", str(a_file / "sub")], "--kv-offload-path"),
        (["--port", "70000"], "--port must be in 0..65535"),
        (["--port", "-1"], "--port must be in 0..65535"),
        (["--host", "192.0.2.1"], "--host '192.0.2.1': not an address of this machine"),
        (["--chat-template", str(tmp / "missing.jinja")], "--chat-template"),
        (["--port-file", str(tmp / "no_dir" / "port")], "--port-file"),
        (["--max-request-body-bytes", "-1"], "--max-request-body-bytes must be >= 0"),
        (["--max-model-len", "0"], "--max-model-len must be >= 1"),
        (["--kv-cache-memory", "lots"], "--kv-cache-memory"),
        (["--model", str(tmp / "no_such_model")], "--model"),
    ]


_CASES = ["offload-path-is-a-file", "offload-path-under-a-file", "port-too-big", "port-negative", "host-not-here",
          "chat-template-missing", "port-file-dir-missing", "body-cap-negative", "max-model-len-0", "kv-memory-bad",
          "model-missing"]


@pytest.mark.parametrize("case", range(len(_CASES)), ids=_CASES)
def test_bad_serve_option_is_one_line_and_exit_2(tmp_path, case):
    """Checked before anything starts: one line naming the flag and the problem, exit code 2, no traceback
    (a --kv-offload-path on a regular file was a traceback of the engine core, 'File exists')."""
    args, says = _bad_serve_options(tmp_path)[case]
    line = _one_error_line(["serve", "--port", "0", *args], 2)
    assert says in line, line


def test_bad_generate_option_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "f").write_text("x")
    line = _one_error_line(["generate", "hi", "--kv-offload-size", "32MiB", "--kv-offload-path",
                            str(tmp_path / "f")], 2)
    assert line.startswith("error: --kv-offload-path") and "is a file, not a directory" in line


def test_option_only_the_engine_core_can_check_is_one_line(tmp_path):
    """max_model_len over the model's is found by the engine core once the model is read: still one line
    (the API process's), no traceback, exit code 1."""
    line = _one_error_line(["serve", "--port", "0", "--port-file", str(tmp_path / "port"), "--max-model-len",
                            "100000", "--kv-cache-memory", "64MiB"], 1, timeout=300)
    assert "max_model_len 100000 exceeds the model's max_position_embeddings" in line, line
