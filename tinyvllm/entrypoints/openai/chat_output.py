"""The assistant message out of the model's text, per choice: the reasoning split off first (when the server
has a ``--reasoning-parser``), then tool calls parsed out of the rest (when the request uses tools).
Streaming (:meth:`ChatOutputParser.feed`) and whole outputs (:meth:`ChatOutputParser.parse`) give the
same split."""

from __future__ import annotations

from tinyvllm.entrypoints.openai.reasoning import ReasoningParser
from tinyvllm.entrypoints.openai.tool_parsers import ParsedToolCall, StreamingToolCallParser, ToolParser


class ChatOutputParser:
    """One choice's output parser.

    Args:
        reasoning: the server's reasoning parser, or None.
        in_reasoning: the prompt ends inside an open thought (the output starts as reasoning).
        tools: the server's tool-call parser when the request uses tools, else None.
    """

    def __init__(self, reasoning: ReasoningParser | None = None, in_reasoning: bool = False,
                 tools: ToolParser | None = None) -> None:
        self.reasoning = reasoning
        self.in_reasoning = in_reasoning
        self.tool_parser = tools
        self._r = reasoning.stream(in_reasoning) if reasoning is not None else None
        self._t = StreamingToolCallParser(tools) if tools is not None else None

    @property
    def num_calls(self) -> int:
        return self._t.num_calls if self._t is not None else 0

    def feed(self, delta: str, final: bool = False) -> tuple[str, str, list[list[dict]]]:
        """Add ``delta``; returns (reasoning to send, content to send, tool-call delta chunks)."""
        reasoning, content = self._r.feed(delta, final) if self._r is not None else ("", delta)
        chunks: list[list[dict]] = []
        if self._t is not None:
            content, chunks = self._t.feed(content, final)
        return reasoning, content, chunks

    def parse(self, text: str) -> tuple[str | None, str | None, list[ParsedToolCall]]:
        """``(reasoning, content, calls)`` of a whole output. Without tools the content is the text after
        the reasoning as it is; with tools, as :meth:`ToolParser.extract` gives it (None if empty)."""
        reasoning: str | None = None
        content: str | None = text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract(text, self.in_reasoning)
        if self.tool_parser is None:
            return reasoning, content, []
        content, calls = self.tool_parser.extract(content or "")
        return reasoning, content, calls
