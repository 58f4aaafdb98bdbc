"""What every tool-call parser shares: the parsed call, the parser interface, and one incremental driver
(:class:`StreamingToolCallParser`) that both streaming and non-streaming parsing go through, so the two can
never disagree.

A parser (one per model family's format, named as vLLM names them: ``hermes``, ``mistral``, ``pythonic``,
``llama3_json``) says two things about the model's text:

* where a call region may start (:meth:`ToolParser.find_start`), and which text at the very end of the
  output may be the beginning of such a start (held back from the content until it is decided);
* what a region holds once enough text is there (:meth:`ToolParser.parse_region`): complete calls, text
  that turned out not to be a call (sent as content), or "not yet" (wait for more text).

The driver sends content up to a region, each call once it is complete (OpenAI's two deltas: ``index``,
``id``, ``type`` and the name with ``arguments: ""``, then the arguments), and, at the end of the output,
drops an unfinished call and a partial start marker: call syntax cut by ``max_tokens`` or a stop string
never reaches the content (issue 41's rule, kept for every format).

The parser also gives the xgrammar structural tag that constrains the output to its format
(:meth:`ToolParser.grammar`): ``tool_choice="required"`` / a named function allow only calls,
``"auto"`` lets free text run until a call's trigger text and then constrains the call.
"""

from __future__ import annotations

import json
import secrets
import string
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = ["ParsedToolCall", "Step", "StreamingToolCallParser", "ToolParser", "call_from_object", "json_span",
           "partial_suffix"]


@dataclass
class ParsedToolCall:
    """One complete call: the function's name, its arguments as JSON text, and the call's id."""

    name: str
    arguments: str  # JSON text of an object
    id: str

    def as_openai(self, index: int | None = None) -> dict:
        d: dict = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            d["index"] = index
        return d


@dataclass
class Step:
    """What :meth:`ToolParser.parse_region` found from ``start``: ``text[start:end]`` is consumed.

    ``calls``: the complete calls in that span (sent as tool calls); ``content``: the span is not a
    call after all (sent as content); ``more``: the region goes on after ``end`` (a list of calls whose
    next element follows), so the next parse is a continuation."""

    end: int
    calls: list[ParsedToolCall] = field(default_factory=list)
    content: bool = False
    more: bool = False


def partial_suffix(text: str, token: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``token``."""
    for n in range(min(len(token) - 1, len(text)), 0, -1):
        if text.endswith(token[:n]):
            return n
    return 0


def json_span(text: str, i: int) -> int | None:
    """End (exclusive) of the JSON object or array that opens at ``text[i]`` (``{`` or ``[``), by
    bracket depth outside strings; None if it is not closed yet. The span is not validated: json.loads it."""
    depth, in_str, esc = 0, False, False
    for j in range(i, len(text)):
        ch = text[j]
        if in_str:
            if esc:
                esc = False
            elif ch == "\\":
                esc = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return j + 1
    return None


def call_from_object(obj: Any, id_: str, args_keys: tuple[str, ...] = ("arguments", "parameters")
                     ) -> ParsedToolCall | None:
    """A call from a decoded ``{"name": ..., "arguments" | "parameters": {...}}``; None if it is not one.
    Arguments given as JSON text (some models write a string) are decoded first."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args: Any = {}
    for k in args_keys:
        if k in obj:
            args = obj[k]
            break
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return ParsedToolCall(obj["name"], json.dumps(args, ensure_ascii=False), id_)


class ToolParser:
    """The interface of a format's parser. Subclasses set :attr:`name` and :attr:`markers` and implement
    :meth:`parse_region` and :meth:`grammar`; :meth:`find_start` defaults to the earliest marker."""

    name: ClassVar[str] = ""
    markers: ClassVar[tuple[str, ...]] = ()  # literal text that opens a call region
    separators: ClassVar[str] = " \t\r\n"  # skipped after a call (between calls, and after the last)

    def make_id(self) -> str:
        """A fresh tool call id (OpenAI's ``call_`` + 24 hex digits unless the format needs another)."""
        return f"call_{secrets.token_hex(12)}"

    def find_start(self, text: str, pos: int, at_boundary: bool) -> tuple[int | None, int | None]:
        """``(start, hold)``: the index in ``text[pos:]`` where a call region starts (or None), and, when
        there is none, the index from which the end of ``text`` may be the beginning of one (or None).
        ``at_boundary``: ``pos`` is the start of the output or just after a call (formats whose calls
        need no marker there, such as Llama 3's bare JSON, use it)."""
        best = None
        for m in self.markers:
            i = text.find(m, pos)
            if i >= 0 and (best is None or i < best):
                best = i
        if best is not None:
            return best, None
        keep = max((partial_suffix(text[pos:], m) for m in self.markers), default=0)
        return None, (len(text) - keep if keep else None)

    def parse_region(self, text: str, start: int, final: bool, cont: bool) -> Step | None:
        """Parse the call region at ``text[start:]`` (``cont``: the continuation of a region after its
        previous call); None if more text is needed to decide. ``final``: no more text will come."""
        raise NotImplementedError

    def grammar(self, tools: list[dict], choice: Any, parallel: bool) -> dict:
        """The xgrammar structural-tag *format* (a dict) of this parser's calls.

        Args:
            tools: checked OpenAI function tools.
            choice: ``"auto"``, ``"required"`` or ``{"name": NAME}``.
            parallel: more than one call allowed (``parallel_tool_calls``; a named choice is one call).
        """
        raise NotImplementedError

    # -------------------------------------------------------------- whole outputs
    def extract(self, text: str) -> tuple[str | None, list[ParsedToolCall]]:
        """``(content, calls)`` of a whole output: the text outside the calls (None if empty; stripped
        when there are calls) and the complete calls. An unfinished call at the end and a partial start
        marker are dropped, never left in the content."""
        s = StreamingToolCallParser(self)
        content, _ = s.feed(text, final=True)
        if s.calls:
            content = content.strip()
        return content or None, s.calls

    def streaming(self) -> "StreamingToolCallParser":
        return StreamingToolCallParser(self)


class StreamingToolCallParser:
    """The incremental driver over a :class:`ToolParser`: feed it each delta of the output text; it
    returns the content to send now and the tool-call deltas."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.text = ""
        self.pos = 0  # text before pos is decided (sent, or dropped)
        self.cont = False  # inside a region, after a call
        self.after_call = False  # skip separators next
        self.boundary = True  # nothing but whitespace and calls so far, or just after a call
        self.pending_ws = ""  # trailing whitespace of the content, held until more text follows it
        self.calls: list[ParsedToolCall] = []
        self.done = False

    @property
    def num_calls(self) -> int:
        return len(self.calls)

    def feed(self, delta: str, final: bool = False) -> tuple[str, list[list[dict]]]:
        """Add ``delta``; returns (content to send now, tool-call deltas to send, one list per chunk)."""
        if self.done:
            return "", []
        self.text += delta
        text, p = self.text, self.parser
        content, chunks = "", []
        while True:
            if self.after_call:
                while self.pos < len(text) and text[self.pos] in p.separators:
                    self.pos += 1
                if self.pos >= len(text) and not final:
                    break
            if self.cont:
                step = p.parse_region(text, self.pos, final, True)
            else:
                start, hold = p.find_start(text, self.pos, self.boundary)
                if start is None:
                    end = len(text) if hold is None else hold
                    if end > self.pos:
                        self.after_call = False
                        self.boundary = self.boundary and not text[self.pos:end].strip()
                    content += text[self.pos:end]
                    self.pos = end if not final else len(text)  # a partial marker at the end: dropped
                    break
                if start > self.pos:
                    self.after_call = False
                    self.boundary = self.boundary and not text[self.pos:start].strip()
                content += text[self.pos:start]
                self.pos = start
                step = p.parse_region(text, start, final, False)
            if step is None:  # undecided: wait; at the end, an unfinished call is dropped
                if final:
                    self.pos = len(text)
                break
            if step.content:
                content += text[self.pos:step.end]
                self.after_call = False
                self.boundary = self.boundary and not text[self.pos:step.end].strip()
            for call in step.calls:
                idx = len(self.calls)
                self.calls.append(call)
                chunks.append([{"index": idx, "id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": ""}}])
                chunks.append([{"index": idx, "function": {"arguments": call.arguments}}])
            if step.calls:
                self.after_call = self.boundary = True
            self.cont = step.more
            if step.end <= self.pos and not step.calls:  # no progress: send one character as content
                content += text[self.pos:self.pos + 1]
                self.boundary = self.boundary and not text[self.pos:self.pos + 1].strip()
                step.end = self.pos + 1
                self.cont = False
            self.pos = step.end
            if self.pos >= len(text) and not self.cont:
                break
        if final:
            self.done = True
        # Whitespace at the end of the content so far is held: sent once text follows it, dropped if the
        # output ends after calls (the newlines between and after calls are not content).
        full = self.pending_ws + content
        content = full.rstrip()
        self.pending_ws = full[len(content):]
        if final and not self.calls:
            content, self.pending_ws = full, ""
        return content, chunks


_ALNUM = string.ascii_letters + string.digits


def alnum_id(n: int = 9) -> str:
    """A random id of ``n`` letters and digits (Mistral's tool call ids are 9 such characters)."""
    return "".join(secrets.choice(_ALNUM) for _ in range(n))
