"""``tinyvllm serve``'s start-up: the engine core process first, the HTTP server's heavy imports after.

The order is what makes the start fast: this module imports nothing heavy (no FastAPI, uvicorn,
transformers, prometheus_client, torch), so right after the flags are parsed and the model is
resolved the engine core process is spawned and starts importing torch and mapping the weights,
while this process imports the server stack (:mod:`tinyvllm.entrypoints.openai.api_server`) and
loads the tokenizer. Only then does it wait for the core's READY message.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import socket

from tinyvllm.config import EngineArgs

logger = logging.getLogger("tinyvllm.api_server")


def _port_free(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def run_server(args: argparse.Namespace) -> int:
    """Start the engine core process and serve HTTP until SIGINT/SIGTERM; returns the exit code."""
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    logging.getLogger().setLevel(level)
    logging.getLogger("tinyvllm").setLevel(level)
    try:
        if args.max_waiting_requests is not None and args.max_waiting_requests < 0:
            raise ValueError(f"--max-waiting-requests must be >= 0, got {args.max_waiting_requests}")
        config = EngineArgs.from_cli_args(args).create_engine_config()
    except (TypeError, ValueError) as e:
        logger.error("invalid engine options: %s", e)
        return 2
    if not _port_free(args.host, args.port):
        logger.error("cannot listen on %s:%d: address already in use", args.host, args.port)
        return 1
    # Until uvicorn takes them over (and again after it hands them back), SIGINT/SIGTERM are only
    # recorded: start-up polls the record and stops in order, so no engine process is left behind.
    signals: list[int] = []
    previous = {sig: signal.signal(sig, lambda signum, frame: signals.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM)}
    engine = None
    try:
        from tinyvllm.engine.async_llm import AsyncLLM

        served = args.served_model_name
        # launch=True: the core process starts before the tokenizer (transformers) loads.
        engine = AsyncLLM(config, served_model_name=served[0] if served else None, log_level=args.log_level,
                          launch=True)
        if signals:
            return 0
        from tinyvllm.entrypoints.openai import api_server  # FastAPI, uvicorn: while the core loads

        if signals:
            return 0
        return asyncio.run(api_server._serve(args, engine, served, signals))
    finally:
        if engine is not None:
            engine.close(timeout=2.0)  # idempotent; covers an exception escaping the event loop
        for sig, handler in previous.items():
            signal.signal(sig, handler)
