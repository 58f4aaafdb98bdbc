"""The flags of ``tinyvllm serve``'s server group (vLLM's names); argparse only, so that building the
parser imports neither the server (FastAPI, uvicorn) nor the engine."""

from __future__ import annotations

import argparse

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
    g.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on every path but --open-paths "
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
    g.add_argument("--tool-call-parser", default="hermes", choices=["hermes"],
                   help="format of the model's tool calls: <tool_call>{\"name\", \"arguments\"}</tool_call>")
    g.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error", "critical"],
                   help="log level of the server and engine")
