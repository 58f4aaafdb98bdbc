"""The grammar of Hermes-style tool calls, as an xgrammar structural tag.

A call is ``<tool_call>\n{"name": "NAME", "arguments": ARGS}\n</tool_call>`` with ``ARGS``
following the tool's JSON schema. ``tool_choice="auto"`` is a *triggered* grammar (free text until
the text ``<tool_call>``, then a call: xgrammar's ``triggered_tags``, the counterpart of llama.cpp's
lazy grammars); ``"required"`` and a named function allow only calls (``tags_with_separator``).
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def _tag(tool: dict) -> dict:
    fn = tool["function"]
    return {"type": "tag", "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(fn["name"])}, "arguments": ',
            "content": {"type": "json_schema", "json_schema": fn["parameters"], "max_whitespace_cnt": 2},
            "end": f"}}\n{TOOL_CALL_END}"}


def tool_structural_tag(tools: list[dict], choice: Any, parallel: bool) -> str | None:
    """The xgrammar structural tag (JSON text) that constrains the output; None for ``none``.

    Args:
        tools: OpenAI function tools (``{"type": "function", "function": {"name", "parameters"}}``).
        choice: ``"auto"``, ``"required"``, ``"none"`` / None, or ``{"name": NAME}`` (a named function).
        parallel: more than one call allowed (``parallel_tool_calls``; a named choice is one call).
    """
    if choice in (None, "none"):
        return None
    if choice == "auto":
        fmt: dict = {"type": "triggered_tags", "triggers": [TOOL_CALL_START], "tags": [_tag(t) for t in tools],
                     "at_least_one": False, "stop_after_first": not parallel}
    else:
        chosen = tools if choice == "required" else [t for t in tools if t["function"]["name"] == choice["name"]]
        fmt = {"type": "tags_with_separator", "tags": [_tag(t) for t in chosen], "separator": "\n",
               "at_least_one": True, "stop_after_first": not parallel or choice != "required"}
    return json.dumps({"type": "structural_tag", "format": fmt})


