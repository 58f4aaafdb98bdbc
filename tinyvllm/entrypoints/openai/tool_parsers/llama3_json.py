"""``llama3_json``: Llama 3.1 / 3.2 / 3.3 JSON calls (Meta's documented "JSON based tool calling")::

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after ``<|python_tag|>``, several separated by ``;``. A call is recognised at the start of the
output (or of what follows a call), after ``<|python_tag|>``, and wherever ``{"name":`` opens one (the
text the grammar's trigger is); a leading JSON object that is not a call (no ``name``, no
``parameters`` / ``arguments`` object) is content. vLLM: ``llama_tool_parser.py`` (``llama3_json``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinyvllm.entrypoints.openai.tool_parsers.base import (Step, ToolParser, call_from_object, json_span,
                                                           partial_suffix)

PYTHON_TAG = "<|python_tag|>"
_NAME_OPEN = '{"name":'
_NAME_OPEN_RE = re.compile(r'\{\s*"name"\s*:')
_PARTIAL_NAME_OPEN_RE = re.compile(r'\{\s*("(n(a(m(e("\s*)?)?)?)?)?)?')  # a cut '{"name":'


def _call_tag(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "tag", "begin": f'{{"name": {json.dumps(fn["name"])}, "parameters": ',
            "content": {"type": "json_schema", "json_schema": fn["parameters"], "max_whitespace_cnt": 2},
            "end": "}"}


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    separators = " \t\r\n;"

    def find_start(self, text: str, pos: int, at_boundary: bool) -> tuple[int | None, int | None]:
        if at_boundary:
            i = pos
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i < len(text) and text[i] == "{":
                return i, None
            if i >= len(text):
                return None, (pos if pos < len(text) else None)
        cands = [i for i in (text.find(PYTHON_TAG, pos),) if i >= 0]
        if (m := _NAME_OPEN_RE.search(text, pos)) is not None:
            cands.append(m.start())
        if cands:
            return min(cands), None
        keep = max(partial_suffix(text[pos:], PYTHON_TAG), partial_suffix(text[pos:], _NAME_OPEN))
        tail = text.rfind("{", pos)  # '{ "name"' with spaces: hold from its brace while it may still be one
        if tail >= 0 and _PARTIAL_NAME_OPEN_RE.fullmatch(text, tail) is not None:
            keep = max(keep, len(text) - tail)
        return None, (len(text) - keep if keep else None)

    def parse_region(self, text: str, start: int, final: bool, cont: bool) -> Step | None:
        i = start
        if text.startswith(PYTHON_TAG, i):
            i += len(PYTHON_TAG)
            while i < len(text) and text[i] in " \t\r\n":
                i += 1
            if i >= len(text):
                return None
            if text[i] != "{":  # built-in tools write Python here (brave_search.call(...)): text
                return Step(i, content=True)
        end = json_span(text, i)
        if end is None:  # at the end, a bare "{" that never closed and never named a function is text
            if final and i == start and _NAME_OPEN_RE.match(text, i) is None and \
                    _PARTIAL_NAME_OPEN_RE.fullmatch(text, i) is None:
                return Step(len(text), content=True)
            return None
        try:
            call = call_from_object(json.loads(text[i:end]), self.make_id(), ("parameters", "arguments"))
        except ValueError:
            call = None
        return Step(end, [call]) if call is not None else Step(end, content=True)

    def grammar(self, tools: list[dict], choice: Any, parallel: bool) -> dict:
        if choice == "auto":
            return {"type": "triggered_tags", "triggers": ['{"name": '], "tags": [_call_tag(t) for t in tools],
                    "at_least_one": False, "stop_after_first": not parallel}
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice["name"]]
        return {"type": "tags_with_separator", "tags": [_call_tag(t) for t in chosen], "separator": "; ",
                "at_least_one": True, "stop_after_first": not parallel or choice != "required"}
