"""``pythonic``: calls written as a Python list of keyword-argument calls (Llama 3.2 / 4's pythonic format,
ToolACE, and the prompt format Google documents for Gemma 3's function calling)::

    [get_weather(city="Paris", unit="celsius"), get_time(zone="CET")]

Values are Python literals (strings, numbers, ``True`` / ``False`` / ``None``, lists, dicts); JSON's
``true`` / ``false`` / ``null`` are read too (the constrained grammar writes JSON values, which are Python
literals but for those three). A region starts at ``[`` followed by a name and ``(``; each call is sent
once its ``)`` is there. vLLM: ``pythonic_tool_parser.py``.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from tinyvllm.entrypoints.openai.tool_parsers.base import ParsedToolCall, Step, ToolParser

_START_RE = re.compile(r"\[\s*[A-Za-z_][A-Za-z0-9_.\-]*\(")
_PARTIAL_START_RE = re.compile(r"\[\s*[A-Za-z0-9_.\-]*")
_CALL_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_.\-]*)\(")
_JSON_NAMES = {"true": True, "false": False, "null": None}


def _close_paren(text: str, i: int) -> int | None:
    """End (exclusive) of the parenthesised argument list opening at ``text[i] == "("``, skipping Python
    strings and nested brackets; None if it is not closed yet."""
    depth, quote, esc = 0, None, False
    for j in range(i, len(text)):
        ch = text[j]
        if quote is not None:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == quote:
                quote = None
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                return j + 1 if ch == ")" else None
    return None


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_value(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {_value(k): _value(v) for k, v in zip(node.keys, node.values) if k is not None}
    return ast.literal_eval(node)


def _kwargs_format(params: dict) -> dict:
    """The structural-tag format of ``key=value, ...`` for a tool's parameters: the required properties
    in schema order, then each optional one (or, with none required, every property), values as JSON."""
    props = params.get("properties") or {}
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}

    def value(k: str) -> dict:
        sub = props[k]
        schema = {**sub, **defs} if isinstance(sub, dict) else sub
        return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 2}

    required = [k for k in params.get("required", []) if k in props]
    forced = required or list(props)
    elements: list[dict] = []
    for n, k in enumerate(forced):
        elements += [{"type": "const_string", "value": f"{', ' if n else ''}{k}="}, value(k)]
    if required:
        for k in props:
            if k not in required:
                elements.append({"type": "optional", "content": {"type": "sequence", "elements": [
                    {"type": "const_string", "value": f", {k}="}, value(k)]}})
    if not elements:
        return {"type": "const_string", "value": ""}
    return {"type": "sequence", "elements": elements}


def _call_tag(tool: dict, begin_prefix: str = "") -> dict:
    fn = tool["function"]
    return {"type": "tag", "begin": f"{begin_prefix}{fn['name']}(", "content": _kwargs_format(fn["parameters"]),
            "end": ")"}


class PythonicToolParser(ToolParser):
    name = "pythonic"
    markers = ("[",)

    def find_start(self, text: str, pos: int, at_boundary: bool) -> tuple[int | None, int | None]:
        m = _START_RE.search(text, pos)
        if m is not None:
            return m.start(), None
        i = text.rfind("[", pos)
        if i >= 0 and _PARTIAL_START_RE.fullmatch(text, i) is not None:
            return None, i
        return None, None

    def parse_region(self, text: str, start: int, final: bool, cont: bool) -> Step | None:
        n = len(text)
        i = start + (0 if cont else 1)
        while i < n and text[i] in " \t\r\n":
            i += 1
        if i >= n:
            return None
        if cont:
            if text[i] == "]":
                return Step(i + 1)
            if text[i] != ",":
                return Step(i, content=True)
            i += 1
            while i < n and text[i] in " \t\r\n":
                i += 1
            if i >= n:
                return None
        m = _CALL_RE.match(text, i)
        if m is None:
            if re.fullmatch(r"[A-Za-z0-9_.\-]*", text[i:]) is not None:
                return None  # a name still being written
            return Step(i, content=True)
        end = _close_paren(text, m.end() - 1)
        if end is None:
            return None
        call = self._parse_call(m.group(1), text[m.end() - 1:end])
        if call is None:
            return Step(end, content=True)
        return Step(end, [call], more=True)

    def _parse_call(self, name: str, args_src: str) -> ParsedToolCall | None:
        try:
            node = ast.parse("f" + args_src, mode="eval").body
            if not isinstance(node, ast.Call) or node.args:
                return None
            args = {kw.arg: _value(kw.value) for kw in node.keywords if kw.arg is not None}
            if len(args) != len(node.keywords):
                return None
            return ParsedToolCall(name, json.dumps(args, ensure_ascii=False), self.make_id())
        except (SyntaxError, ValueError, TypeError, RecursionError):
            return None

    def grammar(self, tools: list[dict], choice: Any, parallel: bool) -> dict:
        if choice == "auto":
            tags = []
            for t in tools:
                first = _call_tag(t)
                rest: list[dict] = [first["content"], {"type": "const_string", "value": ")"}]
                if parallel:
                    rest.append({"type": "star", "content": {"type": "sequence", "elements": [
                        {"type": "const_string", "value": ", "},
                        {"type": "or", "elements": [_call_tag(u) for u in tools]}]}})
                tags.append({"type": "tag", "begin": "[" + first["begin"], "content": {"type": "sequence",
                                                                                      "elements": rest},
                             "end": "]"})
            return {"type": "triggered_tags", "triggers": [tag["begin"] for tag in tags], "tags": tags,
                    "at_least_one": False, "stop_after_first": not parallel}
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice["name"]]
        calls = {"type": "tags_with_separator", "tags": [_call_tag(t) for t in chosen], "separator": ", ",
                 "at_least_one": True, "stop_after_first": not parallel or choice != "required"}
        return {"type": "sequence", "elements": [{"type": "const_string", "value": "["}, calls,
                                                 {"type": "const_string", "value": "]"}]}
