"""Reasoning parsers: the model's thinking, between ``<think>`` and ``</think>``, comes back apart from the
answer, as ``reasoning_content`` (vLLM's ``--reasoning-parser``; vLLM: ``reasoning/qwen3_reasoning_parser.py``,
``reasoning/basic_parsers.py``).

``qwen3`` (Qwen3, and the same rule under ``deepseek_r1``):

* the output is reasoning from a leading ``<think>`` (or from its first character, when the prompt
  itself ends inside an open ``<think>``: templates that start the thought for the model, such as
  DeepSeek-R1's and Qwen3-Thinking-2507's) up to ``</think>``; what follows, less its leading
  whitespace, is the content;
* with neither (Qwen3 with ``enable_thinking: false``, whose template writes an empty
  ``<think></think>`` into the prompt) the whole output is content;
* a thought cut before ``</think>`` (``max_tokens``) is all reasoning, and a partial ``</think`` at the
  end is dropped.

Streaming and non-streaming go through the same incremental parser (:class:`ReasoningStream`), so
they agree on every split of the text.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinyvllm.entrypoints.openai.tool_parsers.base import partial_suffix

__all__ = ["REASONING_PARSERS", "ReasoningParser", "ReasoningStream", "get_reasoning_parser"]

_WS = " \t\r\n"


@dataclass(frozen=True)
class ReasoningParser:
    """A ``start`` ... ``end`` reasoning format."""

    name: str
    start: str = "<think>"
    end: str = "</think>"

    def prompt_opens(self, prompt_tail: str) -> bool:
        """Whether a prompt ending with ``prompt_tail`` leaves a thought open (its last ``start`` is not
        closed), so that the output begins inside the reasoning."""
        i = prompt_tail.rfind(self.start)
        return i >= 0 and prompt_tail.find(self.end, i) < 0

    def stream(self, in_reasoning: bool = False) -> "ReasoningStream":
        return ReasoningStream(self, in_reasoning)

    def extract(self, text: str, in_reasoning: bool = False) -> tuple[str | None, str]:
        """``(reasoning, content)`` of a whole output; reasoning is None when there is none."""
        s = ReasoningStream(self, in_reasoning)
        reasoning, content = s.feed(text, final=True)
        return (reasoning if s.saw_reasoning and reasoning.strip() else None), content

    def grammar_prefix(self, in_reasoning: bool) -> dict:
        """The xgrammar structural-tag format of the reasoning block that may come before constrained
        output (tool calls): optional ``<think>...</think>`` then a blank line; when the prompt opened
        the thought, the output must close it first."""
        block = {"type": "tag", "begin": "" if in_reasoning else self.start,
                 "content": {"type": "any_text", "excludes": [self.start, self.end]}, "end": self.end}
        seq = {"type": "sequence", "elements": [block, {"type": "const_string", "value": "\n\n"}]}
        return seq if in_reasoning else {"type": "optional", "content": seq}


class ReasoningStream:
    """Splits the output, delta by delta, into reasoning and content (see the module's rule)."""

    def __init__(self, parser: ReasoningParser, in_reasoning: bool = False) -> None:
        self.p = parser
        self.state = "reasoning" if in_reasoning else "start"
        self.saw_reasoning = in_reasoning
        self.buf = ""  # undecided text (a possible start / end marker, leading whitespace)

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """Add ``delta``; returns (reasoning to send now, content to send now)."""
        self.buf += delta
        reasoning, content = "", ""
        while self.buf:
            if self.state == "start":
                s = self.buf.lstrip(_WS)
                if s.startswith(self.p.start):
                    self.buf = s[len(self.p.start):]
                    self.state, self.saw_reasoning = "reasoning", True
                    continue
                if not final and self.p.start.startswith(s):  # maybe a "<think>" being written
                    break
                self.state = "content"
            elif self.state == "reasoning":
                i = self.buf.find(self.p.end)
                if i < 0:  # a partial "</think" at the end is held (dropped if the output ends there)
                    keep = partial_suffix(self.buf, self.p.end)
                    reasoning += self.buf[:len(self.buf) - keep]
                    self.buf = "" if final else self.buf[len(self.buf) - keep:]
                    break
                reasoning += self.buf[:i]
                self.buf = self.buf[i + len(self.p.end):]
                self.state = "after"
            elif self.state == "after":  # the whitespace between the thought and the answer
                s = self.buf.lstrip(_WS)
                if not s:
                    if final:
                        self.buf = ""
                    break
                self.buf, self.state = s, "content"
            else:
                content += self.buf
                self.buf = ""
        return reasoning, content


REASONING_PARSERS: dict[str, ReasoningParser] = {
    "qwen3": ReasoningParser("qwen3"),
    "deepseek_r1": ReasoningParser("deepseek_r1"),
}


def get_reasoning_parser(name: str) -> ReasoningParser:
    """A reasoning parser by its vLLM name. Raises ``ValueError`` naming the known ones."""
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(REASONING_PARSERS)}") from None
