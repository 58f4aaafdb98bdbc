"""The EngineCore process: a busy loop that receives requests over ZMQ, steps the engine, sends outputs.

Two ZMQ PUSH/PULL pipes connect it to the API process (``ipc://`` sockets in a
temp dir, which the API process binds; this process connects). Every message is a
type tag and a msgpack payload, all typed in :mod:`tinyvllm.engine.messages`.

The loop drains every pending message without blocking while it has work, and
blocks in ``poll`` (with a timeout, to notice a dead parent) when idle. It sends
an ``OUTPUTS`` message after every step and after any message that changed its
state (an abort frees KV blocks at once, so the API's gauges fall to zero even
when no step follows). Sending right after a step and going straight into the
next one is what lets the API process detokenize step N while step N+1 computes.

The process exits when told to (``SHUTDOWN``), on SIGTERM, or when its parent
dies (``PR_SET_PDEATHSIG`` where available, and a ``getppid`` check otherwise);
SIGINT is ignored so a terminal's Ctrl-C is handled by the API process, which
then shuts this one down in order.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
import traceback
from typing import Any

import msgspec
import zmq

from tinyvllm.config import EngineConfig
from tinyvllm.engine.messages import (ERROR_TAG, OUTPUTS_TAG, READY_TAG, EngineCoreError, EngineCoreOutputs,
                                      EngineCoreReady, EngineCoreRequest, EngineCoreRequestType, encode)

logger = logging.getLogger("tinyvllm.core_proc")

_IDLE_POLL_MS = 500
_KV_PENDING_POLL_MS = 10  # no request, but KV blocks kept for a pull (P/D): step this often to serve / expire them
_PARENT_CHECK_S = 1.0
_add_decoder = msgspec.msgpack.Decoder(list[EngineCoreRequest])
_ids_decoder = msgspec.msgpack.Decoder(list[str])


def _set_pdeathsig() -> None:
    """Ask Linux to SIGTERM this process when its parent dies (no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - best effort
        pass


def _send_error(sock: zmq.Socket, text: str) -> None:
    try:
        sock.send_multipart([ERROR_TAG, encode(EngineCoreError(text))])
    except zmq.ZMQError:  # the API process is gone; nobody to tell
        pass


def run_engine_core(config: EngineConfig, resolved: Any, input_addr: str, output_addr: str,
                    parent_pid: int, log_level: str = "INFO", num_threads: int = 0,
                    dp_rank: int | None = None) -> None:
    """Entry point of the engine core process (a ``multiprocessing`` spawn target). ``num_threads`` > 0 sets
    torch's threads (a data-parallel replica's share of the cores; ``TINYVLLM_NUM_THREADS`` still wins);
    ``dp_rank`` names the replica in the log."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_pdeathsig()
    who = "EngineCore" if dp_rank is None else f"EngineCore_DP{dp_rank}"
    logging.basicConfig(level=getattr(logging, str(log_level).upper(), logging.INFO),
                        format=f"%(asctime)s %(levelname)s %(name)s [{who} pid %(process)d]: %(message)s")
    if num_threads > 0:
        import torch

        torch.set_num_threads(num_threads)
    ctx = zmq.Context()
    in_sock = ctx.socket(zmq.PULL)
    out_sock = ctx.socket(zmq.PUSH)
    for s in (in_sock, out_sock):
        s.setsockopt(zmq.LINGER, 2000)
    out_sock.setsockopt(zmq.SNDTIMEO, 1000)
    in_sock.connect(input_addr)
    out_sock.connect(output_addr)
    code = 0
    try:
        if os.getppid() != parent_pid:
            return
        try:
            from tinyvllm.engine.core import EngineCore

            core = EngineCore(config, resolved)
        except Exception as e:
            # A bad option (max_model_len over the model's, an offload tier that cannot be made): the API
            # process reports it in one line; the traceback only at debug level. (KVTierError by name: this
            # handler must not import what may have failed to import.)
            if isinstance(e, ValueError) or any(c.__name__ == "KVTierError" for c in type(e).__mro__):
                logger.debug("engine core failed to start", exc_info=True)
            else:
                logger.exception("engine core failed to start")
            _send_error(out_sock, f"{type(e).__name__}: {e}")
            code = 1
            return
        stop = {"flag": False}

        def on_term(signum, frame):  # noqa: ARG001
            stop["flag"] = True

        signal.signal(signal.SIGTERM, on_term)
        out_sock.send_multipart([READY_TAG, encode(EngineCoreReady(
            pid=os.getpid(), max_model_len=core.max_model_len, vocab_size=core.model_info.vocab_size,
            eos_token_id=core.model_info.eos_token_id, num_kv_blocks=core.num_blocks,
            block_size=config.cache_config.block_size, load_seconds=core.load_seconds,
            served_name=core.resolved.served_name, dtype=str(core.dtype).replace("torch.", ""),
            quantization=str(getattr(core.model, "quantization", "none"))))])
        try:
            _busy_loop(core, in_sock, out_sock, parent_pid, stop)
        except Exception as e:
            logger.exception("engine core loop failed")
            _send_error(out_sock, f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
            code = 1
        finally:
            if config.parallel_config.tensor_parallel_size > 1:
                core.shutdown()  # the rank processes (in-process workers need nothing)
    finally:
        in_sock.close(0)
        out_sock.close()
        ctx.term()
        if os.getppid() != parent_pid and input_addr.startswith("ipc://"):
            # Orphaned (the API process died): remove the socket directory it cannot clean up.
            shutil.rmtree(os.path.dirname(input_addr[len("ipc://"):]), ignore_errors=True)
        logger.info("engine core process exiting")
    # Everything this process owns is closed above: skip the interpreter's teardown (module and tensor
    # finalizers, 0.3 s with torch loaded, measured), as multiprocessing's fork start method does. What
    # multiprocessing's own exit would still do here: flush the log handlers and the standard streams.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _busy_loop(core: Any, in_sock: zmq.Socket, out_sock: zmq.Socket, parent_pid: int, stop: dict) -> None:
    poller = zmq.Poller()
    poller.register(in_sock, zmq.POLLIN)
    num_added = 0
    last_parent_check = time.monotonic()
    while not stop["flag"]:
        busy = core.has_unfinished_requests()
        kv_pending = not busy and core.has_pending_kv_transfers()
        now = time.monotonic()
        if now - last_parent_check > _PARENT_CHECK_S:
            last_parent_check = now
            if os.getppid() != parent_pid:
                logger.warning("parent process %d is gone; exiting", parent_pid)
                return
            core.model_executor.check_health()  # a dead tensor-parallel rank ends the core (-> 503 in the API)
        ready = poller.poll(0 if busy else _KV_PENDING_POLL_MS if kv_pending else _IDLE_POLL_MS)
        changed = False
        rejected: list[tuple[str, str]] = []
        if ready:
            while True:  # drain everything pending, never blocking
                try:
                    frame, payload = in_sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                changed = True
                try:
                    tag = EngineCoreRequestType(frame)
                except ValueError:
                    logger.error("unknown message type %r", frame)
                    continue
                if tag is EngineCoreRequestType.ADD:
                    for req in _add_decoder.decode(payload):
                        num_added += 1
                        try:
                            core.add_request(req)
                        except Exception as e:  # noqa: BLE001 - a bad request must not stop the engine
                            if not isinstance(e, ValueError):
                                logger.exception("request %s rejected", req.request_id)
                            rejected.append((req.request_id, str(e)))
                elif tag is EngineCoreRequestType.ABORT:
                    core.abort_requests(_ids_decoder.decode(payload))
                elif tag is EngineCoreRequestType.RESET_PREFIX_CACHE:
                    core.reset_prefix_cache()
                elif tag is EngineCoreRequestType.SHUTDOWN:
                    logger.info("shutdown requested")
                    return
        stepped = core.has_unfinished_requests()
        outputs = core.step() if stepped or kv_pending else []
        # (a step that only waited for KV transfers changed nothing the API process needs to hear of)
        if (stepped and not (core.scheduler.connector is not None and core.last_step_idle)) or changed or (
                kv_pending and core.kv_transfers_changed):
            stats = core.make_stats()
            stats.num_added = num_added
            msg = [OUTPUTS_TAG, encode(EngineCoreOutputs(outputs, rejected, stats,
                                                      core.last_iteration if stepped else None, time.monotonic()))]
            while True:  # blocks only if the API process stops reading; never forever
                try:
                    out_sock.send_multipart(msg, copy=False)
                    break
                except zmq.Again:
                    if stop["flag"] or os.getppid() != parent_pid:
                        return
