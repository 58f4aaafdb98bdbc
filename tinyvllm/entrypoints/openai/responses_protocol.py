"""OpenAI Responses API request model (``POST /v1/responses``) and its translation onto the one conversation
model underneath: chat messages and a :class:`ChatCompletionRequest` body.

Strict like the other request models (:class:`OpenAIBaseModel`: nothing coerced, unknown fields logged and
ignored). What the Responses API defines but this server does not do is a 400 naming the field: built-in
tools (web search, file search, computer use, code interpreter, image generation, MCP, shell...), non-text
input (images, files, audio), item references, ``conversation``, ``prompt`` templates, ``truncation: auto``,
``include`` values other than those that need nothing, ``top_logprobs``, ``max_tool_calls``.

Mapping (the input's items, in order, after ``instructions`` as the system message):

* a string -> one user message;
* ``message`` items (``role`` user / system / developer / assistant; ``content`` a string or ``input_text`` /
  ``output_text`` / ``refusal`` parts) -> chat messages;
* ``function_call`` items -> ``tool_calls`` of an assistant message (consecutive calls, and calls right after
  an assistant text message, join that message, as one assistant turn);
* ``function_call_output`` items -> ``tool`` messages (``tool_call_id`` = ``call_id``);
* ``reasoning`` items -> dropped (this server produces none; clients send them back as given);
* ``tools`` (``{"type": "function", "name", "parameters", ...}``) -> chat function tools;
  ``tool_choice`` ``"auto"`` / ``"none"`` / ``"required"`` / ``{"type": "function", "name"}`` -> the same;
* ``text.format`` ``json_schema`` / ``json_object`` / ``text`` -> ``response_format``;
* ``max_output_tokens`` -> ``max_tokens``; ``temperature``, ``top_p``, ``user`` and tinyvllm's sampling
  extensions (``top_k``, ``seed``, ``stop``...) -> the same chat fields.
"""

from __future__ import annotations

import json
from typing import Any

from tinyvllm.engine.input_processor import InvalidRequestError
from tinyvllm.entrypoints.openai.protocol import OpenAIBaseModel, json_type

# Tool types the Responses API defines that this server does not implement (built-in / hosted tools).
REFUSED_TOOLS = {
    "web_search": "built-in web search", "web_search_preview": "built-in web search",
    "web_search_2025_08_26": "built-in web search", "web_search_preview_2025_03_11": "built-in web search",
    "file_search": "built-in file search", "computer": "computer use", "computer_use_preview": "computer use",
    "code_interpreter": "the code interpreter", "image_generation": "image generation", "mcp": "MCP tools",
    "local_shell": "the local shell tool", "shell": "the shell tool", "apply_patch": "the apply_patch tool",
    "custom": "custom (free-form) tools", "namespace": "tool namespaces", "tool_search": "tool search",
}
# Input item types the API defines that this server does not accept.
REFUSED_ITEMS = {
    "item_reference": "item references are not supported (send the item, or use previous_response_id)",
    "file_search_call": "built-in file search is not supported", "web_search_call": "built-in web search is not "
    "supported", "computer_call": "computer use is not supported", "computer_call_output": "computer use is not "
    "supported", "image_generation_call": "image generation is not supported", "code_interpreter_call": "the code "
    "interpreter is not supported", "local_shell_call": "the local shell tool is not supported",
    "local_shell_call_output": "the local shell tool is not supported", "mcp_list_tools": "MCP tools are not "
    "supported", "mcp_approval_request": "MCP tools are not supported", "mcp_approval_response": "MCP tools are not "
    "supported", "mcp_call": "MCP tools are not supported", "custom_tool_call": "custom tools are not supported",
    "custom_tool_call_output": "custom tools are not supported", "compaction": "compaction items are not supported",
}
_REFUSED_PARTS = {"input_image": "image input", "input_file": "file input", "input_audio": "audio input"}
# Top-level fields the API defines that this server does not implement: a value other than "not used" is a 400.
REFUSED_FIELDS = {
    "conversation": "the Conversations API is not supported (use previous_response_id)",
    "prompt": "prompt templates are not supported",
    "max_tool_calls": "max_tool_calls is not supported",
    "top_logprobs": "logprobs are not supported by the Responses endpoint (use /v1/chat/completions)",
    "context_management": "context management is not supported",
}
# include values that need nothing from this server (the rest are 400s)
_OK_INCLUDES = {"reasoning.encrypted_content"}
# tinyvllm / vLLM sampling extensions passed on to the chat request as they are
EXTENSION_FIELDS = ("top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty", "seed", "stop",
                    "stop_token_ids", "ignore_eos", "min_tokens", "logit_bias", "skip_special_tokens",
                    "structured_outputs", "cache_salt", "prefix_cache_debug")


def _bad(message: str, param: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param}: {message}", param)


class ResponsesRequest(OpenAIBaseModel):
    """``POST /v1/responses``."""

    model: str | None = None
    input: str | list[dict[str, Any]] = ""
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True
    stream: bool | None = False
    background: bool | None = False
    previous_response_id: str | None = None
    include: list[str] | None = None
    truncation: str | None = None
    # accepted, not used (no reasoning parser for the served family; one tier; no server-side prompt cache keys)
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: dict[str, Any] | None = None
    # refused when used
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    max_tool_calls: int | None = None
    top_logprobs: int | None = None
    context_management: list[Any] | None = None
    # tinyvllm's extensions (as chat completions)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    skip_special_tokens: bool | None = None
    structured_outputs: dict[str, Any] | None = None
    cache_salt: str | None = None
    prefix_cache_debug: bool | None = None

    # ------------------------------------------------------------------ checks
    def check(self) -> None:
        """Raise ``InvalidRequestError`` for a field this server refuses or a value out of range."""
        for name, reason in REFUSED_FIELDS.items():
            value = getattr(self, name)
            if value not in (None, [], {}, 0):
                raise _bad(reason, name)
        if self.truncation not in (None, "disabled"):
            raise _bad(f"only 'disabled' is supported (the request fails if the input does not fit the "
                       f"context), got {self.truncation!r}", "truncation")
        for i, inc in enumerate(self.include or ()):
            if inc not in _OK_INCLUDES:
                raise _bad(f"{inc!r} is not supported", f"include[{i}]")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise _bad(f"must be at least 1, got {self.max_output_tokens}", "max_output_tokens")
        if self.background and not self.store:
            raise _bad("background responses must be stored (store: true)", "background")
        if self.background and self.stream:
            raise _bad("background responses cannot be streamed by this server (poll GET /v1/responses/{id})",
                       "background")
        if self.metadata is not None:
            if len(self.metadata) > 16:
                raise _bad(f"at most 16 keys, got {len(self.metadata)}", "metadata")
            for k, v in self.metadata.items():
                if len(k) > 64 or len(v) > 512:
                    raise _bad(f"keys are at most 64 characters and values at most 512 (key {k[:64]!r})",
                               "metadata")

    # ------------------------------------------------------------------ translation
    def input_messages(self) -> list[dict]:
        """The input as chat messages (without ``instructions``)."""
        if isinstance(self.input, str):
            return [{"role": "user", "content": self.input}]
        out: list[dict] = []
        for i, item in enumerate(self.input):
            where = f"input[{i}]"
            kind = item.get("type", "message" if "role" in item else None)
            if kind in REFUSED_ITEMS:
                raise _bad(REFUSED_ITEMS[kind], f"{where}.type")
            if kind == "message":
                out.append(_message(item, where))
            elif kind == "function_call":
                call = _function_call(item, where)
                prev = out[-1] if out else None
                if prev is not None and prev["role"] == "assistant":
                    prev.setdefault("tool_calls", []).append(call)
                else:
                    out.append({"role": "assistant", "content": "", "tool_calls": [call]})
            elif kind == "function_call_output":
                if not isinstance(item.get("call_id"), str) or not item["call_id"]:
                    raise _bad("a function_call_output needs a string 'call_id'", f"{where}.call_id")
                out.append({"role": "tool", "tool_call_id": item["call_id"],
                            "content": _output_text(item.get("output"), f"{where}.output")})
            elif kind == "reasoning":
                continue
            else:
                raise _bad(f"unknown input item type {kind!r} (supported: message, function_call, "
                           f"function_call_output)", f"{where}.type")
        return out

    def chat_tools(self) -> list[dict] | None:
        if self.tools is None:
            return None
        tools = []
        for k, t in enumerate(self.tools):
            kind = t.get("type")
            if kind in REFUSED_TOOLS:
                raise _bad(f"{REFUSED_TOOLS[kind]} ({kind!r}) is not supported; give function tools",
                           f"tools[{k}].type")
            if kind != "function":
                raise _bad(f"unknown tool type {kind!r}; give {{\"type\": \"function\", \"name\", \"parameters\"}}",
                           f"tools[{k}].type")
            fn = {key: t[key] for key in ("name", "description", "parameters", "strict") if t.get(key) is not None}
            tools.append({"type": "function", "function": fn})
        return tools

    def chat_tool_choice(self) -> Any:
        tc = self.tool_choice
        if tc is None or isinstance(tc, str):
            return tc
        kind = tc.get("type")
        if kind == "function":
            if not isinstance(tc.get("name"), str):
                raise _bad("a tool_choice of type 'function' needs a string 'name'", "tool_choice.name")
            return {"type": "function", "function": {"name": tc["name"]}}
        raise _bad(f"type {kind!r} is not supported (use 'auto', 'none', 'required' or "
                   f"{{\"type\": \"function\", \"name\": ...}})", "tool_choice.type")

    def response_format(self) -> dict | None:
        fmt = (self.text or {}).get("format")
        if fmt is None:
            return None
        if not isinstance(fmt, dict):
            raise _bad(f"must be an object, got {json_type(fmt)}", "text.format")
        kind = fmt.get("type")
        if kind in ("text", "json_object"):
            return {"type": kind}
        if kind == "json_schema":
            if not isinstance(fmt.get("name"), str):
                raise _bad("a json_schema format needs a string 'name'", "text.format.name")
            if not isinstance(fmt.get("schema"), dict):
                raise _bad("a json_schema format needs a 'schema' object", "text.format.schema")
            js = {"name": fmt["name"], "schema": fmt["schema"]}
            if fmt.get("strict") is not None:
                js["strict"] = fmt["strict"]
            return {"type": "json_schema", "json_schema": js}
        raise _bad(f"type must be 'text', 'json_object' or 'json_schema', got {kind!r}", "text.format.type")

    def chat_body(self, messages: list[dict]) -> dict:
        """The chat completions body of this request over ``messages`` (the whole conversation)."""
        body: dict[str, Any] = {"model": self.model, "messages": messages}
        if (tools := self.chat_tools()) is not None:
            body["tools"] = tools
        if (choice := self.chat_tool_choice()) is not None:
            body["tool_choice"] = choice
        if self.parallel_tool_calls is not None:
            body["parallel_tool_calls"] = self.parallel_tool_calls
        if (rf := self.response_format()) is not None:
            body["response_format"] = rf
        if self.max_output_tokens is not None:
            body["max_tokens"] = self.max_output_tokens
        for name in ("temperature", "top_p", "user", *EXTENSION_FIELDS):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        return body


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "assistant", "system", "developer"):
        raise _bad(f"must be 'user', 'assistant', 'system' or 'developer', got {role!r}", f"{where}.role")
    content = item.get("content")
    if isinstance(content, str):
        text = content
    elif isinstance(content, list):
        parts = []
        for j, p in enumerate(content):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in _REFUSED_PARTS:
                raise _bad(f"{_REFUSED_PARTS[kind]} is not supported", f"{where}.content[{j}].type")
            if kind in ("input_text", "output_text", "text"):
                if not isinstance(p.get("text"), str):
                    raise _bad("a text part needs a string 'text'", f"{where}.content[{j}].text")
                parts.append(p["text"])
            elif kind == "refusal":
                parts.append(str(p.get("refusal", "")))
            else:
                raise _bad(f"unknown content part type {kind!r} (supported: input_text, output_text)",
                           f"{where}.content[{j}].type")
        text = "".join(parts)
    else:
        raise _bad(f"must be a string or a list of content parts, got {json_type(content)}", f"{where}.content")
    return {"role": role, "content": text}


def _function_call(item: dict, where: str) -> dict:
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise _bad(f"a function_call needs a string '{key}'", f"{where}.{key}")
    try:
        json.loads(item["arguments"])
    except ValueError:
        raise _bad("must be a JSON text (the call's arguments)", f"{where}.arguments") from None
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _output_text(output: Any, where: str) -> str:
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        parts = []
        for j, p in enumerate(output):
            kind = p.get("type") if isinstance(p, dict) else None
            if kind in _REFUSED_PARTS:
                raise _bad(f"{_REFUSED_PARTS[kind]} is not supported", f"{where}[{j}].type")
            if kind not in ("input_text", "output_text") or not isinstance(p.get("text"), str):
                raise _bad("only input_text parts are supported", f"{where}[{j}]")
            parts.append(p["text"])
        return "".join(parts)
    raise _bad(f"must be a string or a list of input_text parts, got {json_type(output)}", where)
