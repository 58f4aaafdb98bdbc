"""The ``tinyvllm`` command line: what building and parsing it imports."""

from __future__ import annotations

import subprocess
import sys


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
