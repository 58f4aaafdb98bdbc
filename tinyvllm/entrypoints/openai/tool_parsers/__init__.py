"""Tool-call parsers, one per model family's format, under vLLM's ``--tool-call-parser`` names.

=============== ================================================= =====================================
name            the model writes                                  families
=============== ================================================= =====================================
``hermes``      ``<tool_call>{"name", "arguments"}</tool_call>``  Qwen2.5, Qwen3, Hermes, SmolLM (tinyvllm's
                                                                  own ChatML tool template)
``mistral``     ``[TOOL_CALLS][{"name", "arguments"}, ...]``      Mistral, Ministral, Mixtral
``pythonic``    ``[func(a=1), other(b="x")]``                     Llama 3.2 / 4 (pythonic), Gemma 3
``llama3_json`` ``{"name", "parameters"}`` (``<|python_tag|>``)   Llama 3.1 / 3.2 / 3.3
=============== ================================================= =====================================

``--tool-call-parser auto`` picks one from the chat template's text (:func:`select_tool_parser`).
"""

from __future__ import annotations

from tinyvllm.entrypoints.openai.tool_parsers.base import (ParsedToolCall, StreamingToolCallParser, ToolParser)
from tinyvllm.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from tinyvllm.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from tinyvllm.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from tinyvllm.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser

__all__ = ["TOOL_PARSERS", "HermesToolParser", "Llama3JsonToolParser", "MistralToolParser", "ParsedToolCall",
           "PythonicToolParser", "StreamingToolCallParser", "ToolParser", "get_tool_parser", "select_tool_parser"]

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
    "llama3_json": Llama3JsonToolParser,
}
DEFAULT_TOOL_PARSER = "hermes"


def get_tool_parser(name: str) -> ToolParser:
    """A parser by its vLLM name. Raises ``ValueError`` naming the known ones."""
    try:
        return TOOL_PARSERS[name]()
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; known: {', '.join(TOOL_PARSERS)}") from None


def select_tool_parser(template: str | None) -> str:
    """The parser ``--tool-call-parser auto`` picks from a chat template's text; the first rule that holds:

    1. ``[TOOL_CALLS]`` in the template: ``mistral``;
    2. ``<tool_call>``: ``hermes``;
    3. a pythonic call example (``[func_name`` or ``func_name1(``): ``pythonic``;
    4. ``<|python_tag|>``, or Llama 3's header tokens with a ``"parameters"`` key: ``llama3_json``;
    5. otherwise (a template that shows no tool format, such as Gemma 3's): ``hermes``, the default,
       whose calls tinyvllm's own tool template teaches when the model's template ignores tools.
    """
    t = template or ""
    if "[TOOL_CALLS]" in t:
        return "mistral"
    if "<tool_call>" in t:
        return "hermes"
    if "[func_name" in t or "func_name1(" in t:
        return "pythonic"
    if "<|python_tag|>" in t or ("<|start_header_id|>" in t and "parameters" in t):
        return "llama3_json"
    return DEFAULT_TOOL_PARSER
