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
import errno
import logging
import signal
import socket

from tinyvllm.config import EngineArgs, EngineConfig
from tinyvllm.entrypoints.openai.cli_args import check_server_args, flag_message

logger = logging.getLogger("tinyvllm.api_server")


def _listen_error(host: str, port: int) -> tuple[str, int] | None:
    """Why ``host:port`` cannot be listened on, as (one line naming the flag, exit code), or None.
    A bad ``--host`` is an option error (2); a port in use is the machine's state (1)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except socket.gaierror as e:
            return f"--host {host!r}: cannot resolve this address ({e.strerror})", 2
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"cannot listen on {host}:{port}: address already in use (--port)", 1
            if e.errno == errno.EADDRNOTAVAIL:
                return f"--host {host!r}: not an address of this machine", 2
            if e.errno == errno.EACCES:
                return f"--port {port}: permission denied (ports below 1024 need privileges)", 2
            return f"cannot listen on {host}:{port} (--host, --port): {e.strerror or e}", 1
    return None


def run_headless_node(config: EngineConfig) -> int:
    """Run this node's tensor-parallel ranks without an API server or engine core (node 0 drives them);
    returns 0 when node 0 shuts them down, 1 when a rank fails (its error is logged)."""
    from tinyvllm.config import resolve_device
    from tinyvllm.engine.core import check_parallel
    from tinyvllm.executor.multiproc import run_headless
    from tinyvllm.model.loader import resolve_model

    pc = config.parallel_config
    try:
        resolved = resolve_model(config.model_config.model, config.model_config.load_format)
        check_parallel(config, resolve_device(config.model_config.device), resolved.model_dir)
    except ValueError as e:
        logger.error("invalid engine options: %s", e)
        return 2
    ranks = pc.pipe_ranks()
    logger.info("node %d of %d: tensor-parallel ranks %s of %d, group at %s:%s (no API server on this node)",
                pc.node_rank, pc.nnodes, ranks, pc.tensor_parallel_size, pc.master_addr, pc.master_port)
    return run_headless(config, str(resolved.model_dir), ranks, pc.pipe_ranks_node0)


def run_server(args: argparse.Namespace) -> int:
    """Start the engine core process and serve HTTP until SIGINT/SIGTERM; returns the exit code."""
    level = getattr(logging, str(args.log_level).upper(), logging.INFO)
    logging.getLogger().setLevel(level)
    logging.getLogger("tinyvllm").setLevel(level)
    # Every option error is one line and exit code 2 here, before any process starts (argparse's rule);
    # what only the engine core can find (max_model_len over the model's, disk space) is one line too.
    try:
        check_server_args(args)
    except ValueError as e:
        logger.error("invalid server options: %s", e)
        return 2
    try:
        config = EngineArgs.from_cli_args(args).create_engine_config()
    except (TypeError, ValueError) as e:
        logger.error("invalid engine options: %s", flag_message(str(e)))
        return 2
    if config.parallel_config.headless:  # --node-rank > 0 (or a torchrun rank > 0): this node's ranks only
        return run_headless_node(config)
    if config.parallel_config.data_parallel_size > 1:  # P/D, TP, more replicas than cores: one line, no process
        from tinyvllm.engine.data_parallel import check_data_parallel

        try:
            check_data_parallel(config)
        except ValueError as e:
            logger.error("invalid engine options: %s", flag_message(str(e)))
            return 2
    if config.parallel_config.tensor_parallel_size > 1:  # a size the model cannot split: one line, no process
        from tinyvllm.config import resolve_device
        from tinyvllm.engine.core import check_parallel
        from tinyvllm.model.loader import resolve_model

        try:
            mc = config.model_config
            check_parallel(config, resolve_device(mc.device), resolve_model(mc.model, mc.load_format).model_dir)
        except ValueError as e:
            logger.error("invalid engine options: %s", flag_message(str(e)))
            return 2
    if (err := _listen_error(args.host, args.port)) is not None:
        logger.error("%s", err[0])
        return err[1]
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
        try:
            engine = AsyncLLM(config, served_model_name=served[0] if served else None, log_level=args.log_level,
                              launch=True)
        except ValueError as e:  # ModelNotFoundError, or no usable tokenizer in the model directory
            logger.error("cannot load the model (--model %s): %s", args.model, e)
            return 2
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
