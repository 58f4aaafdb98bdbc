"""AsyncLLM: the API process's client of an EngineCore running in its own process.

The three layers of the serving pipeline, and where each one runs:

* API process (this module and ``entrypoints/openai``): HTTP, validation, chat
  template, tokenization; one asyncio task reads the core's output messages,
  runs the :class:`OutputProcessor` (incremental detokenization, stop strings)
  and pushes per-request deltas into per-request asyncio queues, from which the
  HTTP handlers stream.
* EngineCore process (:mod:`tinyvllm.engine.core_proc`): scheduler + model
  runner, stepping in a busy loop. Model weights are loaded only there.

The two talk over ZMQ PUSH/PULL ``ipc://`` sockets with msgspec msgpack. The core
sends a step's outputs and goes straight on to the next step, so detokenizing
step N overlaps the forward pass of step N+1.

The model is resolved (a GGUF converted and cached) once, here, before the core
process starts; the core gets the resolved directory and only loads it.

Start-up overlaps the two processes: ``AsyncLLM(..., launch=True)`` binds the
sockets and spawns the core right after resolving the model, and only then loads
the tokenizer (transformers) while the core imports torch and maps the weights.
This module therefore imports nothing heavy at import time (no transformers,
tokenizers, prometheus_client): a server imports it before it spawns the core.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import types
from typing import Any, Callable

import msgspec
import zmq
import zmq.asyncio

from tinyvllm import envs
from tinyvllm.config import EngineConfig
from tinyvllm.engine.core_proc import run_engine_core
from tinyvllm.engine.input_processor import InvalidRequestError, check_prompt, fan_out
from tinyvllm.engine.messages import (ERROR_TAG, OUTPUTS_TAG, READY_TAG, EngineCoreError, EngineCoreOutputs,
                                      EngineCoreReady, EngineCoreRequestType, encode)
from tinyvllm.metrics.stats import SchedulerStats
from tinyvllm.model.loader import resolve_model
from tinyvllm.outputs import CompletionOutput, RequestOutput
from tinyvllm.sampling_params import SamplingParams

logger = logging.getLogger("tinyvllm.async_llm")

DEFAULT_START_TIMEOUT_S = envs.TINYVLLM_ENGINE_START_TIMEOUT


class EngineStartError(RuntimeError):
    """The engine core process failed to start (its error, or its exit code, is in the message)."""


class EngineStartCancelled(RuntimeError):
    """Start-up was interrupted (SIGINT/SIGTERM) before the engine became ready."""


class EngineDeadError(RuntimeError):
    """The engine core process died or reported a fatal error; no request can be served."""


class EngineShutdownError(RuntimeError):
    """The server is shutting down; the request was ended."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (``max_waiting_requests``); the server answers 503."""


def _merge_delta(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """Fold delta ``b`` into delta ``a`` (when the reader lags, several deltas queue up)."""
    by_index: dict[int, CompletionOutput] = {c.index: c for c in a.outputs}
    for c in b.outputs:
        p = by_index.get(c.index)
        if p is None:
            by_index[c.index] = c
            continue
        p.text += c.text
        p.token_ids = list(p.token_ids) + list(c.token_ids)
        if c.logprobs is not None:
            p.logprobs = list(p.logprobs or []) + list(c.logprobs)
        p.cumulative_logprob = c.cumulative_logprob
        p.finish_reason, p.stop_reason = c.finish_reason, c.stop_reason
    a.outputs = list(by_index.values())
    a.finished = b.finished
    a.metrics = b.metrics
    a.num_cached_tokens = b.num_cached_tokens
    a.kv_cost = b.kv_cost
    a.prefix_cache = a.prefix_cache if b.prefix_cache is None else b.prefix_cache
    if b.prompt_logprobs is not None:
        a.prompt_logprobs = b.prompt_logprobs
    a.num_cached_tokens_tier = b.num_cached_tokens_tier
    a.kv_transfer_params = b.kv_transfer_params or a.kv_transfer_params
    return a


class RequestStream:
    """Async iterator over one request's delta :class:`RequestOutput` objects.

    Deltas that queued up while the consumer was busy are merged into one. The
    iterator ends after the finished output; it raises the engine's error if the
    engine died or is shutting down. Call :meth:`abort` (idempotent) when the
    consumer goes away before the end.
    """

    def __init__(self, engine: "AsyncLLM", request_id: str, queue: asyncio.Queue) -> None:
        self.engine = engine
        self.request_id = request_id
        self._queue = queue
        self.finished = False
        self._pending_error: BaseException | None = None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        if self._pending_error is not None:
            self._fail(self._pending_error)
        item = await self._queue.get()
        if isinstance(item, BaseException):
            self._fail(item)
        while not item.finished and not self._queue.empty():
            nxt = self._queue.get_nowait()
            if isinstance(nxt, BaseException):
                self._pending_error = nxt
                break
            item = _merge_delta(item, nxt)
        if item.finished:
            self.finished = True
            self.engine._forget(self.request_id)
        return item

    def _fail(self, err: BaseException) -> None:
        self.finished = True
        self.engine.abort(self.request_id)
        raise err

    def abort(self) -> None:
        """Abort the request in the engine unless it already finished."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncLLM:
    """Front end of an engine core process.

    Args:
        config: engine configuration (the core process builds its EngineCore from it).
        served_model_name: name reported by the API (default: the model's own name).
        log_level: logging level for the core process.
        start_timeout: seconds to wait for the core to load the model.

    Raises:
        ModelNotFoundError: the model cannot be found (raised here, in the API process).
    """

    def __init__(self, config: EngineConfig, served_model_name: str | None = None, log_level: str = "INFO",
                 start_timeout: float = DEFAULT_START_TIMEOUT_S, *, launch: bool = False) -> None:
        self.config = config
        self.log_level = log_level
        self.start_timeout = start_timeout
        self.resolved = resolve_model(config.model_config.model, config.model_config.load_format)
        self.model_name = served_model_name or self.resolved.served_name
        self.max_waiting_requests = config.scheduler_config.max_waiting_requests
        self.max_model_len = 0
        self.vocab_size = 0
        self.eos_token_ids: list[int] = []
        self.engine_info: EngineCoreReady | None = None
        self.stats = SchedulerStats()
        self._queues: dict[str, asyncio.Queue] = {}
        self._num_sent = 0
        self._accepting = False
        self._dead: BaseException | None = None
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._tmpdir: str | None = None
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._in_sock: zmq.Socket | None = None
        self._out_sock: zmq.asyncio.Socket | None = None
        self._output_task: asyncio.Task | None = None
        self._stopped = False
        self._launched_at = 0.0
        # Called (in the event loop) once the core has died; the server uses it to exit.
        self.on_dead: Callable[[BaseException], None] | None = None
        # Called (in the event loop) with every OUTPUTS message and its request outputs; the dashboard.
        self.step_listeners: list[Callable[[EngineCoreOutputs, list[RequestOutput]], None]] = []
        self._output_decoder = msgspec.msgpack.Decoder(EngineCoreOutputs)
        self._ready_decoder = msgspec.msgpack.Decoder(EngineCoreReady)
        self._error_decoder = msgspec.msgpack.Decoder(EngineCoreError)
        if launch:  # the core loads the model while this process imports transformers and the tokenizer
            self.launch()
        try:
            from tinyvllm.engine.output_processor import OutputProcessor
            from tinyvllm.engine.tokenizer import load_tokenizer
            from tinyvllm.metrics.prometheus import ServerMetrics

            self.tokenizer = load_tokenizer(self.resolved.model_dir)
            self.processor = OutputProcessor(self.tokenizer)
            self.metrics = ServerMetrics(self.model_name)
        except BaseException:
            self.close(timeout=2.0)  # no core process left behind
            raise

    # ------------------------------------------------------------------ lifecycle
    @property
    def engine_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def accepting(self) -> bool:
        """True between a successful :meth:`start` and the beginning of shutdown (or the core's death)."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        return self._dead is None and self._proc is not None and self._proc.is_alive()

    def launch(self) -> None:
        """Bind the two ``ipc://`` sockets and spawn the core process (it connects and loads the model);
        returns at once. Idempotent; :meth:`start` calls it if it has not run."""
        if self._proc is not None:
            return
        self._tmpdir = tempfile.mkdtemp(prefix="tinyvllm-ipc-")
        in_addr = f"ipc://{self._tmpdir}/input"
        out_addr = f"ipc://{self._tmpdir}/output"
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        self._in_sock = self._sync_ctx.socket(zmq.PUSH)
        self._in_sock.setsockopt(zmq.SNDHWM, 0)
        self._in_sock.setsockopt(zmq.LINGER, 0)
        self._in_sock.bind(in_addr)
        self._out_sock = self._async_ctx.socket(zmq.PULL)
        self._out_sock.setsockopt(zmq.RCVHWM, 0)
        self._out_sock.setsockopt(zmq.LINGER, 0)
        self._out_sock.bind(out_addr)
        mp = multiprocessing.get_context("spawn")
        self._proc = mp.Process(target=run_engine_core, name="EngineCore",
                                args=(self.config, self.resolved, in_addr, out_addr, os.getpid(), self.log_level))
        self._proc.start()
        self._launched_at = time.monotonic()
        logger.info("engine core process started (pid %d); loading %s", self._proc.pid, self.resolved.model_dir)

    async def start(self, should_cancel: Callable[[], bool] | None = None) -> None:
        """Start the core process (unless :meth:`launch` did) and wait until it reports ready.

        Raises:
            EngineStartError: the core failed to load, exited, or did not become ready in time.
            EngineStartCancelled: ``should_cancel()`` turned true while waiting.
        """
        self.launch()
        assert self._proc is not None and self._out_sock is not None
        deadline = self._launched_at + self.start_timeout
        while True:
            if await self._out_sock.poll(100):
                tag, payload = await self._out_sock.recv_multipart()
                if tag == READY_TAG:
                    self.engine_info = self._ready_decoder.decode(payload)
                    break
                if tag == ERROR_TAG:
                    raise EngineStartError(f"engine core failed to start: {self._error_decoder.decode(payload).message}")
                continue
            if not self._proc.is_alive():
                raise EngineStartError(f"engine core process exited with code {self._proc.exitcode} during "
                                       "start-up (see its log above)")
            if should_cancel is not None and should_cancel():
                raise EngineStartCancelled("start-up interrupted")
            if time.monotonic() > deadline:
                raise EngineStartError(f"engine core did not become ready within {self.start_timeout:.0f}s")
        info = self.engine_info
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        from tinyvllm.engine.tokenizer import eos_token_ids

        self.eos_token_ids = eos_token_ids(self.tokenizer, types.SimpleNamespace(eos_token_id=info.eos_token_id))
        self.stats = SchedulerStats(kv_blocks_total=info.num_kv_blocks)
        self.metrics.update_from_stats(self.stats)
        self._accepting = True
        self._output_task = asyncio.create_task(self._output_loop(), name="tinyvllm-output-loop")
        logger.info("engine core ready: max_model_len %d, %d KV blocks x %d tokens", self.max_model_len,
                    info.num_kv_blocks, info.block_size)

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Stop accepting requests and end every in-flight request with :class:`EngineShutdownError`."""
        self._accepting = False
        self._fail_all(EngineShutdownError(reason))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """End in-flight requests, stop the output task, stop the core process (join, then kill)."""
        if self._output_task is not None:
            self._output_task.cancel()
            try:
                await self._output_task
            except BaseException:  # noqa: BLE001 - cancelled or already failed
                pass
            self._output_task = None
        self.begin_shutdown()
        await asyncio.to_thread(self._stop_process, timeout)
        self._close_sockets()

    def close(self, timeout: float = 5.0) -> None:
        """Synchronous shutdown (no event loop needed): stop the core process, close sockets. Idempotent."""
        self._accepting = False
        self._stop_process(timeout)
        self._close_sockets()

    def _stop_process(self, timeout: float) -> None:
        """Tell the core to exit and join it; terminate, then kill, if it does not."""
        proc = self._proc
        if proc is None or self._stopped:
            return
        self._stopped = True
        if proc.is_alive():
            if self.engine_info is not None:
                self._send(EngineCoreRequestType.SHUTDOWN, b"", raise_if_dead=False)
            else:  # still loading: it reads no messages yet
                proc.terminate()
            proc.join(timeout)
            if proc.is_alive():
                logger.warning("engine core did not exit in %.1fs; terminating", timeout)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
        logger.info("engine core process %d exited (code %s)", proc.pid, proc.exitcode)

    def _close_sockets(self) -> None:
        for sock in (self._in_sock, self._out_sock):
            if sock is not None:
                sock.close(0)
        self._in_sock = self._out_sock = None
        for ctx in (self._sync_ctx, self._async_ctx):
            if ctx is not None:
                ctx.term()
        self._sync_ctx = self._async_ctx = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ requests
    def _send(self, kind: EngineCoreRequestType, payload: Any, raise_if_dead: bool = True) -> None:
        data = payload if isinstance(payload, bytes) else encode(payload)
        try:
            if self._in_sock is None:
                raise zmq.Again()
            self._in_sock.send_multipart([kind.value, data], flags=zmq.NOBLOCK)
        except zmq.ZMQError as e:  # no connected peer: the core is gone
            if raise_if_dead:
                raise EngineDeadError(f"cannot reach the engine core ({e})") from e

    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Validate a tokenized request against the engine's limits.

        Raises:
            InvalidRequestError: empty prompt, prompt (+ max_tokens) longer than
                ``max_model_len``, or token ids outside the vocabulary.
        """
        check_prompt(prompt_token_ids, params, self.max_model_len, self.vocab_size, check_max_tokens=True)

    def num_waiting_estimate(self) -> int:
        """Sequences waiting in the core (last snapshot) plus those sent since the core last reported."""
        in_transit = self._num_sent - self.stats.num_added
        return self.stats.num_waiting + max(0, in_transit)

    def check_admission(self) -> None:
        """Raise :class:`EngineDeadError` / :class:`EngineShutdownError` / :class:`EngineOverloadedError`
        when a new request cannot be accepted now."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine core is dead: {self._dead}")
        if not self._accepting:
            raise EngineShutdownError("the server is not accepting requests (starting up or shutting down)")
        if self.max_waiting_requests is not None:
            waiting = self.num_waiting_estimate()
            if waiting >= self.max_waiting_requests:
                raise EngineOverloadedError(
                    f"the server is overloaded: {waiting} requests are waiting (max_waiting_requests="
                    f"{self.max_waiting_requests}); retry later")

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], params: SamplingParams,
                    arrival_time: float | None = None, *, checked: bool = False, prefix_cache_debug: bool = False,
                    user: str | None = None) -> RequestStream:
        """Validate (unless ``checked``: the caller ran :meth:`check_request`), admit and send a request
        to the core; returns the stream of its delta outputs. ``prefix_cache_debug`` asks the core for a
        prefix-cache report; ``user`` labels the request's KV cost in ``/metrics``.

        Raises:
            InvalidRequestError: see :meth:`check_request`.
            EngineOverloadedError, EngineShutdownError, EngineDeadError: see :meth:`check_admission`.
        """
        if not checked:
            self.check_request(prompt_token_ids, params)
        self.check_admission()
        if request_id in self._queues:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        arrival = arrival_time or time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        reqs = fan_out(request_id, prompt_token_ids, params, self.eos_token_ids, arrival)
        if prefix_cache_debug:
            for r in reqs:
                r.prefix_cache_debug = True
        try:  # encoded before anything is registered: a value msgpack cannot carry leaves no state behind
            payload = encode(reqs)
        except (OverflowError, TypeError, ValueError, msgspec.EncodeError) as e:
            raise InvalidRequestError(f"the request cannot be sent to the engine: {e}") from e
        self.processor.add_request(request_id, prompt, prompt_token_ids, params, arrival)
        self._queues[request_id] = queue
        self.metrics.request_added(request_id, arrival, user)
        try:
            self._send(EngineCoreRequestType.ADD, payload)
        except BaseException:  # whatever fails after registration unregisters the request
            self._forget(request_id)
            self.processor.abort_request(request_id)
            raise
        self._num_sent += len(reqs)
        return RequestStream(self, request_id, queue)

    def abort(self, request_id: str) -> None:
        """Forget a request and abort its unfinished samples in the core (KV blocks freed next loop)."""
        self._forget(request_id)
        kids = self.processor.abort_request(request_id)
        if kids:
            self._send(EngineCoreRequestType.ABORT, kids, raise_if_dead=False)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.metrics.request_aborted(request_id)

    def tracked_state(self) -> dict[str, int]:
        """What this process and (as of its last report) the engine core hold: ``api_streams`` (request
        queues), ``api_output_requests`` / ``api_output_samples`` (output processor), ``api_metrics_requests``
        (per-request timing state), ``core_running`` / ``core_waiting`` (sequences) and ``core_kv_blocks_used``.
        All zero on an idle server that leaks nothing."""
        return {"api_streams": len(self._queues), "api_output_requests": len(self.processor.requests),
                "api_output_samples": len(self.processor.child_to_parent),
                "api_metrics_requests": self.metrics.num_tracked_requests,
                "core_running": self.stats.num_running, "core_waiting": self.stats.num_waiting,
                "core_kv_blocks_used": self.stats.kv_blocks_used}

    def reset_prefix_cache(self) -> None:
        self._send(EngineCoreRequestType.RESET_PREFIX_CACHE, b"")

    def _fail_all(self, err: BaseException) -> None:
        kids: list[str] = []
        for rid in list(self._queues):
            self._queues[rid].put_nowait(err)
            kids.extend(self.processor.abort_request(rid))
        if kids and self._dead is None:
            self._send(EngineCoreRequestType.ABORT, kids, raise_if_dead=False)

    # ------------------------------------------------------------------ output loop
    async def _output_loop(self) -> None:
        assert self._out_sock is not None and self._proc is not None
        try:
            while True:
                if not await self._out_sock.poll(1000):
                    if not self._proc.is_alive():
                        raise EngineDeadError(f"the engine core process died (exit code {self._proc.exitcode})")
                    continue
                tag, payload = await self._out_sock.recv_multipart()
                if tag == OUTPUTS_TAG:
                    self._handle_outputs(self._output_decoder.decode(payload))
                elif tag == ERROR_TAG:
                    raise EngineDeadError(f"the engine core failed: {self._error_decoder.decode(payload).message}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            logger.error("engine output loop stopped: %s", e, exc_info=not isinstance(e, EngineDeadError))
            self._dead = e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))
            self._accepting = False
            self._fail_all(self._dead)
            if self.on_dead is not None:
                self.on_dead(self._dead)

    def _handle_outputs(self, msg: EngineCoreOutputs) -> None:
        now = time.monotonic()
        if msg.scheduler_stats is not None:
            self.stats = msg.scheduler_stats
            self.metrics.update_from_stats(msg.scheduler_stats)
        for cid, err in msg.rejected:
            parent = self.processor.child_to_parent.get(cid)
            if parent is None:
                continue
            queue = self._queues.get(parent)
            self.abort(parent)
            if queue is not None:
                queue.put_nowait(InvalidRequestError(err))
        if not msg.outputs:
            if self.step_listeners:
                self._notify(msg, [])
            return
        outs, to_abort = self.processor.process_outputs(msg.outputs, delta=True)
        if to_abort:  # stop strings matched here; free the samples' KV in the core
            self._send(EngineCoreRequestType.ABORT, to_abort, raise_if_dead=False)
        for out in outs:
            self.metrics.record_output(out, now)
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)
        if self.step_listeners:
            self._notify(msg, outs)

    def _notify(self, msg: EngineCoreOutputs, outs: list[RequestOutput]) -> None:
        for listener in self.step_listeners:
            try:
                listener(msg, outs)
            except Exception:  # noqa: BLE001 - an observer must never stop the output loop
                logger.exception("step listener %r failed", listener)
