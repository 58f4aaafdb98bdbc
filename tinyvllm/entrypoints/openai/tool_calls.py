"""Tool calling: the request's ``tools`` / ``tool_choice`` checked, turned into a grammar in the format of the
server's tool-call parser, and the model's output parsed back into OpenAI ``tool_calls``.

The formats and their parsers live in :mod:`tinyvllm.entrypoints.openai.tool_parsers` (``hermes``, the
default; ``mistral``; ``pythonic``; ``llama3_json``; docs/tools-and-reasoning.md). With ``hermes`` the
model writes a call as (Hermes / Qwen / tinyvllm's own template, ``templates/hermes_tool_chat.jinja``)::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

* ``tool_choice="required"`` or a named function: the whole output is one call (or, with
  ``parallel_tool_calls``, several) whose arguments follow the tool's JSON schema, by construction (an
  xgrammar structural tag in the parser's format);
* ``"auto"``: free text, and the text that opens a call (``<tool_call>``, ``[TOOL_CALLS]``, ...) triggers
  the grammar of a call (``triggered_tags``, xgrammar's lazy grammar); the arguments then follow the
  schema too;
* ``"none"``: the tools are not shown to the model and nothing is parsed.

A call cut before its end (``max_tokens``, a stop string) is dropped, in the content and in the stream
alike: the call syntax never reaches ``content`` (README, issue 41).
"""

from __future__ import annotations

import json
import re
import uuid
from importlib import resources
from typing import Any

from tinyvllm.engine.input_processor import InvalidRequestError
from tinyvllm.entrypoints.openai.tool_parsers import TOOL_PARSERS, HermesToolParser, ParsedToolCall, ToolParser
from tinyvllm.entrypoints.openai.tool_parsers import StreamingToolCallParser as _Driver
from tinyvllm.structured_output.tools import tool_structural_tag

__all__ = ["HermesToolParser", "ParsedToolCall", "StreamingToolCallParser", "builtin_tool_template",
           "check_tool_choice", "check_tools", "tool_grammar", "tool_structural_tag"]

TOOL_CALL_PARSERS = tuple(TOOL_PARSERS)
_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


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


class StreamingToolCallParser(_Driver):
    """The incremental tool-call parser of a stream (:class:`tool_parsers.StreamingToolCallParser`), over
    ``parser`` or, by default, the Hermes format."""

    def __init__(self, parser: ToolParser | None = None) -> None:
        super().__init__(parser if parser is not None else HermesToolParser())


def make_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_grammar(parser: ToolParser, tools: list[dict], choice: Any, parallel: bool,
                 prefix: dict | None = None) -> str | None:
    """The xgrammar structural tag (JSON text) that constrains the output to ``parser``'s calls; None for
    ``none``. ``prefix``: a format the output starts with first (a reasoning block, see
    :func:`tinyvllm.entrypoints.openai.reasoning.reasoning_prefix`)."""
    if choice in (None, "none"):
        return None
    fmt = parser.grammar(tools, choice, parallel)
    if prefix is not None:
        fmt = {"type": "sequence", "elements": [prefix, fmt]}
    return json.dumps({"type": "structural_tag", "format": fmt})
