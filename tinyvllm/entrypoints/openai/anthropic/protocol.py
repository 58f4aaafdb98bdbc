"""Anthropic Messages API request models (``POST /v1/messages``, ``/v1/messages/count_tokens``) and their
translation onto the one conversation model underneath: a :class:`ChatCompletionRequest`.

Strict like the OpenAI models (:class:`OpenAIBaseModel`: nothing coerced, unknown fields logged and ignored).
Fields and content blocks the Messages API defines but this server does not implement (images, documents,
thinking, server tools such as web search, MCP servers...) are 400s naming them.

Mapping: ``system`` -> a system message; ``text`` blocks -> message text; ``tool_use`` blocks (assistant) ->
``tool_calls`` (id, function name, arguments as a JSON string); ``tool_result`` blocks (user) -> ``tool``
messages with ``tool_call_id`` = ``tool_use_id``; ``tools[].input_schema`` -> function ``parameters``;
``tool_choice`` ``auto``/``any``/``tool``/``none`` -> ``auto``/``required``/named/``none``
(``disable_parallel_tool_use`` -> ``parallel_tool_calls: false``); ``stop_sequences`` -> ``stop``; a final
assistant message (a prefill) -> ``continue_final_message``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from tinyvllm.engine.input_processor import InvalidRequestError
from tinyvllm.entrypoints.openai.protocol import ChatCompletionRequest, OpenAIBaseModel, json_type

# Content block types the Messages API defines that this server does not implement.
_REFUSED_BLOCKS = {
    "image": "image content blocks are not supported",
    "document": "document content blocks are not supported",
    "search_result": "search_result content blocks are not supported",
    "thinking": "thinking content blocks are not supported",
    "redacted_thinking": "redacted_thinking content blocks are not supported",
    "server_tool_use": "server tools (e.g. web search) are not supported",
    "web_search_tool_result": "server tools (e.g. web search) are not supported",
    "web_fetch_tool_result": "server tools (e.g. web fetch) are not supported",
    "code_execution_tool_result": "server tools (code execution) are not supported",
    "mcp_tool_use": "MCP tools are not supported",
    "mcp_tool_result": "MCP tools are not supported",
    "container_upload": "container uploads are not supported",
}
# Top-level fields the Messages API defines that this server does not implement (value -> "not used").
_REFUSED_FIELDS = {
    "thinking": "extended thinking is not supported",
    "mcp_servers": "MCP servers are not supported",
    "container": "containers (code execution) are not supported",
    "context_management": "context management is not supported",
}


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param)


class AnthropicMessage(OpenAIBaseModel):
    role: str
    content: str | list[dict[str, Any]]


class _MessagesFields(OpenAIBaseModel):
    model: str | None = None
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    mcp_servers: list[Any] | None = None
    container: Any = None
    context_management: dict[str, Any] | None = None

    def _check_refused(self) -> None:
        for name, reason in _REFUSED_FIELDS.items():
            value = getattr(self, name)
            if value is None or value == [] or (name == "thinking" and value.get("type") == "disabled"):
                continue
            raise _bad(reason, name)

    def _system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system
        parts = []
        for j, b in enumerate(self.system):
            if b.get("type") != "text" or not isinstance(b.get("text"), str):
                raise _bad(f"only text blocks ({{\"type\": \"text\", \"text\": ...}}) are supported, got type "
                           f"{b.get('type')!r}", f"system[{j}]")
            parts.append(b["text"])
        return "\n\n".join(parts)

    def _chat_messages(self) -> list[dict]:
        out: list[dict] = []
        if (system := self._system_text()) is not None:
            out.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            if m.role not in ("user", "assistant"):
                raise _bad(f"must be 'user' or 'assistant', got {m.role!r}", f"messages[{i}].role")
            if isinstance(m.content, str):
                out.append({"role": m.role, "content": m.content})
                continue
            texts: list[str] = []
            calls: list[dict] = []
            results: list[dict] = []
            for j, b in enumerate(m.content):
                where = f"messages[{i}].content[{j}]"
                kind = b.get("type")
                if kind in _REFUSED_BLOCKS:
                    raise _bad(_REFUSED_BLOCKS[kind], f"{where}.type")
                if kind == "text":
                    if not isinstance(b.get("text"), str):
                        raise _bad("a text block needs a string 'text'", f"{where}.text")
                    texts.append(b["text"])
                elif kind == "tool_use":
                    if m.role != "assistant":
                        raise _bad("tool_use blocks are only allowed in assistant messages", f"{where}.type")
                    if not isinstance(b.get("id"), str) or not b["id"]:
                        raise _bad("a tool_use block needs a string 'id'", f"{where}.id")
                    if not isinstance(b.get("name"), str):
                        raise _bad("a tool_use block needs a string 'name'", f"{where}.name")
                    if not isinstance(b.get("input", {}), dict):
                        raise _bad(f"must be an object, got {json_type(b.get('input'))}", f"{where}.input")
                    calls.append({"id": b["id"], "type": "function",
                                  "function": {"name": b["name"],
                                               "arguments": json.dumps(b.get("input", {}), ensure_ascii=False)}})
                elif kind == "tool_result":
                    if m.role != "user":
                        raise _bad("tool_result blocks are only allowed in user messages", f"{where}.type")
                    if not isinstance(b.get("tool_use_id"), str):
                        raise _bad("a tool_result block needs a string 'tool_use_id'", f"{where}.tool_use_id")
                    results.append({"role": "tool", "tool_call_id": b["tool_use_id"],
                                    "content": self._result_text(b.get("content"), f"{where}.content",
                                                                 bool(b.get("is_error")))})
                else:
                    raise _bad(f"unknown content block type {kind!r} (supported: text, tool_use, tool_result)",
                               f"{where}.type")
            if m.role == "assistant":
                msg: dict = {"role": "assistant", "content": "".join(texts)}
                if calls:
                    msg["tool_calls"] = calls
                out.append(msg)
            else:  # tool results answer the previous assistant turn: they come first, then the user's text
                out.extend(results)
                if texts or not results:
                    out.append({"role": "user", "content": "\n\n".join(texts)})
        return out

    @staticmethod
    def _result_text(content: Any, where: str, is_error: bool) -> str:
        if content is None:
            text = ""
        elif isinstance(content, str):
            text = content
        elif isinstance(content, list):
            parts = []
            for k, b in enumerate(content):
                if not isinstance(b, dict) or b.get("type") != "text" or not isinstance(b.get("text"), str):
                    kind = b.get("type") if isinstance(b, dict) else None
                    raise _bad(_REFUSED_BLOCKS.get(kind, "only text blocks are supported in a tool_result"),
                               f"{where}[{k}].type")
                parts.append(b["text"])
            text = "\n\n".join(parts)
        else:
            raise _bad(f"must be a string or a list of text blocks, got {json_type(content)}", where)
        return f"Error: {text}" if is_error else text

    def _chat_tools(self) -> tuple[list[dict] | None, Any, bool]:
        """OpenAI ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
        tools = None
        if self.tools is not None:
            tools = []
            for k, t in enumerate(self.tools):
                kind = t.get("type")
                if kind not in (None, "custom"):
                    raise _bad(f"tool type {kind!r} is not supported (server tools such as web search are not); "
                               f"give client tools: {{\"name\", \"description\", \"input_schema\"}}",
                               f"tools[{k}].type")
                if "input_schema" not in t:
                    raise _bad("a tool needs an 'input_schema'", f"tools[{k}].input_schema")
                fn = {"name": t.get("name"), "parameters": t["input_schema"]}
                if t.get("description") is not None:
                    fn["description"] = t["description"]
                tools.append({"type": "function", "function": fn})
        tc = self.tool_choice
        if tc is None:
            return tools, None, True
        kind = tc.get("type")
        parallel = tc.get("disable_parallel_tool_use") is not True
        if kind in ("any", "tool") and not self.tools:
            raise _bad(f"a tool_choice of type {kind!r} needs tools", "tool_choice")
        if kind in ("auto", "none"):
            return tools, kind, parallel
        if kind == "any":
            return tools, "required", parallel
        if kind == "tool":
            if not isinstance(tc.get("name"), str):
                raise _bad("a tool_choice of type 'tool' needs a string 'name'", "tool_choice.name")
            return tools, {"type": "function", "function": {"name": tc["name"]}}, parallel
        raise _bad(f"type must be 'auto', 'any', 'tool' or 'none', got {kind!r}", "tool_choice.type")

    def _chat_body(self) -> dict:
        self._check_refused()
        tools, choice, parallel = self._chat_tools()
        messages = self._chat_messages()
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if messages[-1]["role"] == "assistant" and not messages[-1].get("tool_calls"):
            # a final assistant message is a prefill: the answer continues it (as Anthropic does)
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        if tools is not None:
            body["tools"] = tools
        if choice is not None:
            body["tool_choice"] = choice
        if not parallel:
            body["parallel_tool_calls"] = False
        return body


class MessagesRequest(_MessagesFields):
    """``POST /v1/messages``. ``max_tokens`` is required, as in Anthropic's API."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None  # accepted, not used
    service_tier: str | None = None  # accepted, not used

    def to_chat_request(self) -> ChatCompletionRequest:
        """The same conversation as an OpenAI chat completions request (raises ``InvalidRequestError``)."""
        if self.max_tokens < 1:
            raise _bad(f"must be at least 1, got {self.max_tokens}", "max_tokens")
        body = self._chat_body()
        body["max_tokens"] = self.max_tokens
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.stop_sequences:
            body["stop"] = self.stop_sequences
        return ChatCompletionRequest.model_validate(body)


class CountTokensRequest(_MessagesFields):
    """``POST /v1/messages/count_tokens``."""

    def to_chat_request(self) -> ChatCompletionRequest:
        return ChatCompletionRequest.model_validate(self._chat_body())
