"""``mistral``: Mistral's ``[TOOL_CALLS]`` calls. Two shapes, by tokenizer version (vLLM's ``mistral`` parser
reads both; ``entrypoints/openai/tool_parsers/mistral_tool_parser.py``):

* up to v7 (Mistral-7B-Instruct-v0.3, Ministral-8B-2410, Mistral-Small-2409): one JSON array of calls::

      [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": ...}]

* v11 and later (Mistral-Small-3.2, Magistral, Devstral): the name, then the arguments object, one
  ``[TOOL_CALLS]`` per call (``[ARGS]`` between them in some versions)::

      [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{"zone": "CET"}

Ids are 9 letters and digits, the only ids Mistral's templates accept in ``[TOOL_RESULTS]``. The
grammar writes the array shape. ``[TOOL_CALLS]`` is a special token in Mistral's tokenizers: the server
turns ``skip_special_tokens`` off for requests with tools, so the text keeps it.
"""

from __future__ import annotations

import json
import re
from typing import Any

from tinyvllm.entrypoints.openai.tool_parsers.base import (Step, ToolParser, alnum_id, call_from_object,
                                                           json_span)

BOT = "[TOOL_CALLS]"
ARGS = "[ARGS]"
_NAME_RE = re.compile(r"[A-Za-z0-9_.\-]+")


def _call_tag(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "tag", "begin": f'{{"name": {json.dumps(fn["name"])}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": fn["parameters"], "max_whitespace_cnt": 2},
            "end": "}"}


class MistralToolParser(ToolParser):
    name = "mistral"
    markers = (BOT,)

    def make_id(self) -> str:
        return alnum_id(9)

    def parse_region(self, text: str, start: int, final: bool, cont: bool) -> Step | None:
        n = len(text)
        i = start
        if cont:  # inside the array, after a call: ", {next}" or "]"
            while i < n and text[i] in " \t\r\n":
                i += 1
            if i >= n:
                return None
            if text[i] == "]":
                return Step(i + 1)
            if text[i] != ",":
                return Step(i, content=True)  # not the array's syntax: the rest is text
            return self._array_element(text, i + 1, final)
        i = start + len(BOT)
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            return None
        if text[i] == "[":
            return self._array_element(text, i + 1, final)
        m = _NAME_RE.match(text, i)  # v11: NAME [ARGS] {...}
        if m is None:
            return Step(i, content=True)
        j = m.end()
        if text.startswith(ARGS, j):
            j += len(ARGS)
        elif j >= n or ARGS.startswith(text[j:]):
            return None
        if j >= n:
            return None
        if text[j] != "{":
            return Step(j, content=True)
        end = json_span(text, j)
        if end is None:
            return None
        try:
            args = json.loads(text[j:end])
        except ValueError:
            return Step(end, content=True)
        call = call_from_object({"name": m.group(0), "arguments": args}, self.make_id())
        return Step(end, [call]) if call is not None else Step(end, content=True)

    def _array_element(self, text: str, i: int, final: bool) -> Step | None:
        n = len(text)
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            return None
        if text[i] == "]":  # an empty array
            return Step(i + 1)
        if text[i] != "{":
            return Step(i, content=True)
        end = json_span(text, i)
        if end is None:
            return None
        try:
            call = call_from_object(json.loads(text[i:end]), self.make_id())
        except ValueError:
            call = None
        if call is None:
            return Step(end, content=True)
        return Step(end, [call], more=True)

    def grammar(self, tools: list[dict], choice: Any, parallel: bool) -> dict:
        if choice == "auto":
            calls = {"type": "tags_with_separator", "tags": [_call_tag(t) for t in tools], "separator": ", ",
                     "at_least_one": True, "stop_after_first": not parallel}
            return {"type": "triggered_tags", "triggers": [BOT],
                    "tags": [{"type": "tag", "begin": BOT + "[", "content": calls, "end": "]"}],
                    "at_least_one": False, "stop_after_first": not parallel}
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice["name"]]
        calls = {"type": "tags_with_separator", "tags": [_call_tag(t) for t in chosen], "separator": ", ",
                 "at_least_one": True, "stop_after_first": not parallel or choice != "required"}
        return {"type": "sequence", "elements": [{"type": "const_string", "value": BOT + "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}
