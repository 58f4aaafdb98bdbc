"""The flags of ``tinyvllm serve``'s server group (vLLM's names); argparse only, so that building the
parser imports neither the server (FastAPI, uvicorn) nor the engine."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re

from tinyvllm.config import EngineArgs


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """HTTP server flags (vLLM's names), with the server-only engine options (``--max-waiting-requests``)."""
    g = parser.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (0: any free port, logged)")
    g.add_argument("--port-file", default=None, metavar="PATH",
                   help="write the port listened on to PATH once bound (with --port 0: how a caller learns it)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) the model is served under (none: the model's name); the first is reported")
    EngineArgs.add_cli_args(g, group="server")
    g.add_argument("--api-key", default=None, nargs="+",
                   help="require 'Authorization: Bearer <key>' on every path but --open-paths; several keys: any "
                        "one is accepted (a stored /v1/responses response is visible only with its own key) "
                        "(default: $TINYVLLM_API_KEY; unset: no key)")
    g.add_argument("--open-paths", nargs="*", default=["/health", "/metrics", "/version"],
                   help="paths served without the API key")
    g.add_argument("--allowed-origins", nargs="*", default=None,
                   help="CORS: origins allowed to call the server from a browser ('*' for any); default none")
    g.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024,
                   help="larger request bodies get 413 (0: no cap); default 16 MiB")
    g.add_argument("--chat-template", default=None, metavar="PATH",
                   help="Jinja chat template replacing the model's (default: the model's; for requests with "
                        "tools, tinyvllm's Hermes-style template when the model's ignores tools)")
    g.add_argument("--tool-call-parser", default="hermes",
                   choices=["hermes", "mistral", "pythonic", "llama3_json", "auto"],
                   help="format of the model's tool calls (vLLM's names): hermes <tool_call>{...}</tool_call> "
                        "(Qwen2.5, Qwen3; the default), mistral [TOOL_CALLS][...], pythonic [f(a=1)], "
                        "llama3_json {\"name\", \"parameters\"}; auto: chosen from the chat template "
                        "(docs/tools-and-reasoning.md)")
    g.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines; tool_choice 'auto' is always available here")
    g.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="return the model's <think>...</think> as reasoning_content (vLLM's names); "
                        "default: none (the thinking stays in the content)")
    g.add_argument("--responses-store-path", default=None, metavar="PATH",
                   help="SQLite file of the /v1/responses store (stored responses survive a restart); ':memory:' "
                        "keeps them in the server process only (default: $TINYVLLM_CACHE/responses.sqlite)")
    g.add_argument("--responses-store-max-count", type=int, default=10_000,
                   help="most stored responses (least recently used evicted first); default 10000")
    g.add_argument("--responses-store-max-bytes", type=int, default=256 << 20,
                   help="most bytes of stored responses (least recently used evicted first); default 256 MiB")
    g.add_argument("--responses-store-ttl", type=float, default=7 * 86400.0, metavar="SECONDS",
                   help="a stored response unused this long expires; default 604800 (7 days)")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="log level of the server and engine")


def check_server_args(args: argparse.Namespace) -> None:
    """Check what argparse cannot about the server flags, before anything starts (a bad value then fails in
    one line at once, not with a traceback after the model has loaded).

    Raises:
        ValueError: the message names the flag (``--port must be in 0..65535, got 70000``).
    """
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be in 0..65535, got {args.port}")
    if args.max_request_body_bytes is not None and args.max_request_body_bytes < 0:
        raise ValueError(f"--max-request-body-bytes must be >= 0 (0: no cap), got {args.max_request_body_bytes}")
    if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
        raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
    for name in args.served_model_name or ():
        if not name.strip():
            raise ValueError("--served-model-name: a name must not be empty")
    if args.port_file:
        parent = os.path.dirname(os.path.abspath(args.port_file))
        if os.path.isdir(args.port_file):
            raise ValueError(f"--port-file {args.port_file!r} is a directory")
        if not os.path.isdir(parent):
            raise ValueError(f"--port-file {args.port_file!r}: the directory {parent!r} does not exist")
    for flag in ("responses_store_max_count", "responses_store_max_bytes", "responses_store_ttl"):
        value = getattr(args, flag, None)
        if value is not None and not value > 0:
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    store_path = getattr(args, "responses_store_path", None)
    if store_path and store_path != ":memory:" and os.path.isdir(store_path):
        raise ValueError(f"--responses-store-path {store_path!r} is a directory (give a file path)")
    template = getattr(args, "chat_template", None)
    if template is not None:
        if not os.path.isfile(template):
            raise ValueError(f"--chat-template {template!r}: no such file")
        try:
            with open(template, encoding="utf-8") as f:
                f.read()
        except OSError as e:
            raise ValueError(f"--chat-template {template!r}: cannot read it ({e.strerror})") from None
        except UnicodeDecodeError:
            raise ValueError(f"--chat-template {template!r}: not UTF-8 text") from None


_FIELDS = {f.name for f in dataclasses.fields(EngineArgs)}


def flag_message(message: str) -> str:
    """A config error's message with its leading option name as the flag (``kv_offload_path ...`` ->
    ``--kv-offload-path ...``), for the command line."""
    m = re.match(r"([a-z_]+)\b", message)
    if m and m.group(1) in _FIELDS:
        return "--" + m.group(1).replace("_", "-") + message[m.end():]
    return message
