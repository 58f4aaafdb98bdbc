"""Tool calling: the request's ``tools`` / ``tool_choice`` checked, turned into a grammar, and the
model's Hermes-style output parsed back into OpenAI ``tool_calls``.

The model writes a call as (Hermes / Qwen / tinyvllm's own template,
``templates/hermes_tool_chat.jinja``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* ``tool_choice="required"`` or a named function: the whole output is one call (or, with
  ``parallel_tool_calls``, several separated by newlines) whose arguments follow the tool's JSON
  schema, by construction (an xgrammar structural tag, ``tags_with_separator``);
* ``"auto"``: free text, and the text ``<tool_call>`` triggers the grammar of a call
  (``triggered_tags``, xgrammar's lazy grammar); the arguments then follow the schema too;
* ``"none"``: the tools are not shown to the model and nothing is parsed.

A call cut before its ``</tool_call>`` (``max_tokens``, a stop string) is dropped, in the content and
in the stream alike: the call syntax never reaches ``content`` (README, issue 41).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from importlib import resources
from typing import Any

from tinyvllm.engine.input_processor import InvalidRequestError
from tinyvllm.structured_output.tools import TOOL_CALL_END, TOOL_CALL_START, tool_structural_tag

__all__ = ["HermesToolParser", "StreamingToolCallParser", "builtin_tool_template", "check_tool_choice",
           "check_tools", "tool_structural_tag"]

TOOL_CALL_PARSERS = ("hermes",)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def builtin_tool_template() -> str:
    """tinyvllm's tool-capable ChatML chat template (Jinja text)."""
    return resources.files("tinyvllm.entrypoints.openai").joinpath("templates/hermes_tool_chat.jinja").read_text()


def check_tools(tools: Any) -> list[dict]:
    """The request's ``tools``, checked: OpenAI function tools with a name and an object schema.

    Raises:
        InvalidRequestError: ``param="tools"``.
    """
    if not isinstance(tools, list) or not tools:
        raise InvalidRequestError("tools must be a non-empty list", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}", "tools")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must match [A-Za-z0-9_.-]{{1,64}}", "tools")
        if name in names:
            raise InvalidRequestError(f"tools[{i}].function.name {name!r} is not unique", "tools")
        names.add(name)
        if fn.get("strict") is not None and not isinstance(fn["strict"], bool):
            raise InvalidRequestError(f"tools[{i}].function.strict must be a boolean (true or false)", "tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema of type object",
                                      "tools")
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def check_tool_choice(tool_choice: Any, tools: list[dict] | None) -> str | None:
    """``"none" | "auto" | "required"`` or a function name (a named choice); None without tools.

    Raises:
        InvalidRequestError: ``param="tool_choice"`` (unknown value, unknown function name, a choice
            other than ``none`` without tools).
    """
    if tool_choice is None:
        return "auto" if tools else None
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InvalidRequestError(f"tool_choice must be 'none', 'auto', 'required' or a named function, "
                                      f"got {tool_choice!r}", "tool_choice")
        if tool_choice != "none" and not tools:
            raise InvalidRequestError(f"tool_choice {tool_choice!r} needs tools", "tool_choice")
        return tool_choice if tools else None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" and isinstance(
            tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        known = [t["function"]["name"] for t in tools or []]
        if name not in known:
            raise InvalidRequestError(f"tool_choice names function {name!r}, which is not in tools "
                                      f"({', '.join(known) or 'none given'})", "tool_choice")
        return {"name": name}  # type: ignore[return-value]
    raise InvalidRequestError("tool_choice must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", "tool_choice")


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ParsedToolCall:
    name: str
    arguments: str  # JSON text
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        d: dict = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


def _parse_one(body: str) -> ParsedToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False), make_call_id())


class HermesToolParser:
    """Parses ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` blocks out of the model's text."""

    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """``(content, calls)``: the text outside the blocks (None if empty) and the parsed calls.

        An unfinished call (a ``<tool_call>`` with no ``</tool_call>`` after it: the output was cut by
        ``max_tokens`` or a stop string) is dropped, as is a partial ``<tool_call`` at the very end: the
        call syntax never reaches the content. The complete calls before it are returned.
        """
        text = _drop_unfinished(text)
        calls = [c for c in (_parse_one(m.group(1)) for m in _CALL_RE.finditer(text)) if c is not None]
        if not calls:
            return text or None, []
        content = _CALL_RE.sub("", text).strip()
        return content or None, calls


def _drop_unfinished(text: str) -> str:
    """``text`` without an unfinished call at its end (from its ``<tool_call>`` on) or a partial
    ``<tool_call`` suffix."""
    i = text.rfind(TOOL_CALL_START)
    if i >= 0 and text.find(TOOL_CALL_END, i) < 0:
        return text[:i].rstrip()
    keep = _partial_suffix(text, TOOL_CALL_START)
    return text[:len(text) - keep].rstrip() if keep else text


class StreamingToolCallParser:
    """Incremental form of :class:`HermesToolParser` for SSE: text before a ``<tool_call>`` streams as
    content (a partial ``<tool_call`` at the end is held back); each call is sent once complete, as
    OpenAI sends them: a first delta with ``index``, ``id``, ``type`` and the name (arguments ``""``),
    then the arguments."""

    def __init__(self) -> None:
        self.buffer = ""
        self.in_call = False
        self.num_calls = 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[list[dict]]]:
        """Add ``delta``; returns (content to send now, tool-call deltas to send, one list per chunk)."""
        self.buffer += delta
        content, chunks = "", []
        while True:
            if not self.in_call:
                i = self.buffer.find(TOOL_CALL_START)
                if i < 0:  # a partial "<tool_call" at the end: held back, dropped at the end of the output
                    keep = _partial_suffix(self.buffer, TOOL_CALL_START)
                    content += self.buffer[:len(self.buffer) - keep]
                    self.buffer = "" if final else self.buffer[len(self.buffer) - keep:]
                    break
                content += self.buffer[:i]
                self.buffer = self.buffer[i:]
                self.in_call = True
            j = self.buffer.find(TOOL_CALL_END)
            if j < 0:
                if final:  # an unfinished call (cut by max_tokens or a stop string): dropped
                    self.buffer = ""
                break
            body = self.buffer[len(TOOL_CALL_START):j]
            self.buffer = self.buffer[j + len(TOOL_CALL_END):].lstrip("\n")
            self.in_call = False
            call = _parse_one(body)
            if call is None:
                content += TOOL_CALL_START + body + TOOL_CALL_END
                continue
            idx = self.num_calls
            self.num_calls += 1
            chunks.append([{"index": idx, "id": call.id, "type": "function",
                            "function": {"name": call.name, "arguments": ""}}])
            chunks.append([{"index": idx, "function": {"arguments": call.arguments}}])
        if self.num_calls and not content.strip():
            content = ""  # the newlines between calls are not content
        return content, chunks


def _partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0
