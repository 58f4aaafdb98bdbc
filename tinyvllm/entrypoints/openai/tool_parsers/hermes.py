"""``hermes``: Hermes-style calls, as Qwen2.5, Qwen3 (and tinyvllm's own ChatML tool template) write them::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

One call per ``<tool_call>`` block; several blocks for parallel calls. A block whose body is not a call
(not JSON, no name) is sent as content, as vLLM's ``hermes`` parser does (vLLM:
``entrypoints/openai/tool_parsers/hermes_tool_parser.py``). The grammar is the structural tag of
:mod:`tinyvllm.structured_output.tools`.
"""

from __future__ import annotations

import json
from typing import Any

from tinyvllm.entrypoints.openai.tool_parsers.base import Step, ToolParser, call_from_object
from tinyvllm.structured_output.tools import TOOL_CALL_END, TOOL_CALL_START, tool_structural_tag


class HermesToolParser(ToolParser):
    name = "hermes"
    markers = (TOOL_CALL_START,)

    def parse_region(self, text: str, start: int, final: bool, cont: bool) -> Step | None:
        body_start = start + len(TOOL_CALL_START)
        j = text.find(TOOL_CALL_END, body_start)
        if j < 0:
            return None
        end = j + len(TOOL_CALL_END)
        try:
            call = call_from_object(json.loads(text[body_start:j].strip()), self.make_id())
        except ValueError:
            call = None
        return Step(end, [call]) if call is not None else Step(end, content=True)

    def grammar(self, tools: list[dict], choice: Any, parallel: bool) -> dict:
        return json.loads(tool_structural_tag(tools, choice, parallel))["format"]
