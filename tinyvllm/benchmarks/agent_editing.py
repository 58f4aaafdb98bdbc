"""The ``agent-editing`` benchmark dataset: what a coding agent sends while it edits a file.

Each request is one turn of an agent loop, written as a completion prompt (it also works as a chat
user message): the agent called ``read_file`` (tool-call JSON), got the file back (a tool result
holding the code), was asked for a small edit (rename one identifier), and has started its
``write_file`` call, whose ``content`` argument the model now writes. A good answer is the file
again with one change, so most of it is already in the prompt: the traffic speculative decoding is
for (prompt lookup and SuffixDecoding copy it). Consecutive requests work on the same few files and
tool names, as an agent does turn after turn.

The files are functions of tinyvllm's own source (the installed package, read with ``ast``), so
nothing is downloaded and the text is real code. Deterministic for a seed.
"""

from __future__ import annotations

import ast
import json
import random
from importlib import resources
from pathlib import Path

from tinyvllm.benchmarks.datasets import RequestSpec

_MODULES = ("request.py", "sampling_params.py", "core/block_pool.py", "core/kv_cache_manager.py",
            "core/scheduler.py", "benchmarks/metrics.py", "engine/output_processor.py")
_SYSTEM = ("You are a coding agent. You can call tools by writing <tool_call>{json}</tool_call>. Tools: "
           '{"name": "read_file", "parameters": {"path": "string"}}, '
           '{"name": "write_file", "parameters": {"path": "string", "content": "string"}}, '
           '{"name": "run_tests", "parameters": {"path": "string"}}.')


def _functions(min_lines: int = 8, max_lines: int = 40) -> list[tuple[str, str, list[str]]]:
    """``(path, source, local names)`` of top-level functions and methods in tinyvllm's own modules."""
    root = resources.files("tinyvllm")
    out = []
    for rel in _MODULES:
        src = Path(str(root.joinpath(rel))).read_text()
        lines = src.splitlines()
        for node in ast.walk(ast.parse(src)):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.end_lineno is None:
                continue
            n = node.end_lineno - node.lineno + 1
            if not min_lines <= n <= max_lines:
                continue
            body = lines[node.lineno - 1:node.end_lineno]
            indent = len(body[0]) - len(body[0].lstrip())
            code = "\n".join(ln[indent:] for ln in body)
            names = sorted({a.arg for a in node.args.args if a.arg not in ("self", "cls")} |
                           {t.id for t in ast.walk(node) if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)})
            names = [x for x in names if len(x) > 2]
            if names:
                out.append((f"tinyvllm/{rel}", code, names))
    return out


def agent_editing_prompts(num: int, tokenizer=None, seed: int = 0) -> list[str]:  # noqa: ANN001
    """``num`` prompts (text), as :func:`agent_editing_dataset` builds them (``tokenizer`` is unused;
    accepted so callers may pass one)."""
    return [s.prompt for s in agent_editing_dataset(num, 0, seed=seed)]  # type: ignore[misc]


def agent_editing_dataset(num: int, output_len: int, seed: int = 0) -> list[RequestSpec]:
    """``num`` agent-editing requests asking for ``output_len`` tokens each.

    Sessions of 4 consecutive requests edit the same file (a function of tinyvllm's source): the
    first renames one identifier, the next ones rename others in the previous answer's place, so
    the file, the tool names and the JSON repeat turn after turn.
    """
    rng = random.Random(seed)
    funcs = _functions()
    specs = []
    session = None
    for i in range(num):
        if i % 4 == 0:
            session = funcs[rng.randrange(len(funcs))]
        path, code, names = session  # type: ignore[misc]
        old = names[rng.randrange(len(names))]
        new = old + "_" + rng.choice(["new", "v2", "renamed", "local", "tmp"])
        history = "\n".join(
            f'<tool_call>{{"name": "run_tests", "arguments": {{"path": "{path}"}}}}</tool_call>\n'
            "<tool_result>all tests passed</tool_result>" for _ in range(i % 4))
        prompt = (f"{_SYSTEM}\n\n{history}\n" if history else f"{_SYSTEM}\n\n") + (
            f'<tool_call>{{"name": "read_file", "arguments": {{"path": "{path}"}}}}</tool_call>\n'
            f"<tool_result>{json.dumps({'path': path, 'content': code})}</tool_result>\n"
            f"User: rename `{old}` to `{new}` in {path} and write the whole function back.\n"
            f'<tool_call>{{"name": "write_file", "arguments": {{"path": "{path}", "content": "')
        specs.append(RequestSpec(prompt=prompt, max_tokens=output_len, prompt_len=len(prompt) // 4))
    return specs
