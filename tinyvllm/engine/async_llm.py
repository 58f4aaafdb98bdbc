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


class _Replica:
    """One engine core process and its two sockets (``--data-parallel-size`` N: N of these)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self.proc: multiprocessing.process.BaseProcess | None = None
        self.in_sock: zmq.Socket | None = None
        self.out_sock: zmq.asyncio.Socket | None = None
        self.info: EngineCoreReady | None = None
        self.stats = SchedulerStats()
        self.num_sent = 0
        self.task: asyncio.Task | None = None

    @property
    def name(self) -> str:
        return f"data-parallel replica {self.index}"


class AsyncLLM:
    """Front end of the engine core process (or, with ``data_parallel_size`` N, of N replicas: each request
    goes to one, chosen by :class:`~tinyvllm.engine.data_parallel.DPRouter`; the death of any one ends them all).

    Args:
        config: engine configuration (the core process builds its EngineCore from it).
        served_model_name: name reported by the API (default: the model's own name).
        log_level: logging level for the core process.
        start_timeout: seconds to wait for the core to load the model.

    Raises:
        ModelNotFoundError: the model cannot be found (raised here, in the API process).
        ValueError: a data-parallel size this machine or these options cannot run (one line).
    """

    data_parallel_size = 1  # replicas (class defaults: an instance made without __init__ has one, no router)
    router = None  # a DPRouter once started, with data_parallel_size > 1

    def __init__(self, config: EngineConfig, served_model_name: str | None = None, log_level: str = "INFO",
                 start_timeout: float = DEFAULT_START_TIMEOUT_S, *, launch: bool = False) -> None:
        from tinyvllm.engine.data_parallel import check_data_parallel

        check_data_parallel(config)
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
        self.data_parallel_size = config.parallel_config.data_parallel_size
        self._replicas = [_Replica(i) for i in range(self.data_parallel_size)]
        self._queues: dict[str, asyncio.Queue] = {}
        self._num_sent = 0
        self._accepting = False
        self._dead: BaseException | None = None
        self._tmpdir: str | None = None
        self._sync_ctx: zmq.Context | None = None
        self._async_ctx: zmq.asyncio.Context | None = None
        self._stopped = False
        self._launched = False
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
            self.metrics = ServerMetrics(self.model_name, num_engines=self.data_parallel_size)
        except BaseException:
            self.close(timeout=2.0)  # no core process left behind
            raise

    # ------------------------------------------------------------------ lifecycle
    # (replica 0's process and sockets under their single-engine names)
    @property
    def _proc(self) -> multiprocessing.process.BaseProcess | None:
        return self._replicas[0].proc

    @property
    def _in_sock(self) -> zmq.Socket | None:
        return self._replicas[0].in_sock

    @_in_sock.setter
    def _in_sock(self, sock: Any) -> None:
        self._replicas[0].in_sock = sock

    @property
    def engine_pid(self) -> int | None:
        """The (first) engine core's pid."""
        return self._proc.pid if self._proc is not None else None

    @property
    def engine_pids(self) -> list[int | None]:
        """Every replica's engine core pid (one entry without data parallelism)."""
        return [r.proc.pid if r.proc is not None else None for r in self._replicas]

    @property
    def accepting(self) -> bool:
        """True between a successful :meth:`start` and the beginning of shutdown (or the core's death)."""
        return self._accepting

    @property
    def is_running(self) -> bool:
        """Every engine core is alive (one dead replica is a dead engine: the server exits)."""
        return self._dead is None and all(r.proc is not None and r.proc.is_alive() for r in self._replicas)

    def launch(self) -> None:
        """Bind two ``ipc://`` sockets per engine core and spawn the core process(es) (each connects and
        loads the model); returns at once. Idempotent; :meth:`start` calls it if it has not run."""
        if self._launched:
            return
        self._launched = True
        from tinyvllm.engine.data_parallel import replica_config, replica_threads

        self._tmpdir = tempfile.mkdtemp(prefix="tinyvllm-ipc-")
        self._sync_ctx = zmq.Context()
        self._async_ctx = zmq.asyncio.Context()
        mp = multiprocessing.get_context("spawn")
        threads = replica_threads(self.config)
        dp = self.data_parallel_size
        for r in self._replicas:
            suffix = str(r.index) if dp > 1 else ""
            in_addr = f"ipc://{self._tmpdir}/input{suffix}"
            out_addr = f"ipc://{self._tmpdir}/output{suffix}"
            r.in_sock = self._sync_ctx.socket(zmq.PUSH)
            r.in_sock.setsockopt(zmq.SNDHWM, 0)
            r.in_sock.setsockopt(zmq.LINGER, 0)
            r.in_sock.bind(in_addr)
            r.out_sock = self._async_ctx.socket(zmq.PULL)
            r.out_sock.setsockopt(zmq.RCVHWM, 0)
            r.out_sock.setsockopt(zmq.LINGER, 0)
            r.out_sock.bind(out_addr)
            args: tuple = (replica_config(self.config, r.index), self.resolved, in_addr, out_addr, os.getpid(),
                           self.log_level)
            if dp > 1:
                args += (threads, r.index)
            r.proc = mp.Process(target=run_engine_core, name="EngineCore" + (f"_DP{r.index}" if dp > 1 else ""),
                                args=args)
            r.proc.start()
        self._launched_at = time.monotonic()
        if dp > 1:
            logger.info("%d engine core processes started (pids %s, %d threads each); loading %s", dp,
                        ", ".join(str(p) for p in self.engine_pids), threads, self.resolved.model_dir)
        else:
            logger.info("engine core process started (pid %d); loading %s", self._proc.pid, self.resolved.model_dir)

    async def start(self, should_cancel: Callable[[], bool] | None = None) -> None:
        """Start the core process(es) (unless :meth:`launch` did) and wait until every one reports ready.

        Raises:
            EngineStartError: a core failed to load, exited, or did not become ready in time.
            EngineStartCancelled: ``should_cancel()`` turned true while waiting.
        """
        self.launch()
        deadline = self._launched_at + self.start_timeout
        dp = self.data_parallel_size
        for r in self._replicas:
            assert r.proc is not None and r.out_sock is not None
            who = f"{r.name}: " if dp > 1 else ""
            while True:
                if await r.out_sock.poll(100):
                    tag, payload = await r.out_sock.recv_multipart()
                    if tag == READY_TAG:
                        r.info = self._ready_decoder.decode(payload)
                        break
                    if tag == ERROR_TAG:
                        raise EngineStartError(f"{who}engine core failed to start: "
                                               f"{self._error_decoder.decode(payload).message}")
                    continue
                if not r.proc.is_alive():
                    raise EngineStartError(f"{who}engine core process exited with code {r.proc.exitcode} during "
                                           "start-up (see its log above)")
                for other in self._replicas:  # a replica that fails while another still loads
                    if other is not r and other.info is None and other.proc is not None and not other.proc.is_alive():
                        raise EngineStartError(f"{other.name}: engine core process exited with code "
                                               f"{other.proc.exitcode} during start-up (see its log above)")
                if should_cancel is not None and should_cancel():
                    raise EngineStartCancelled("start-up interrupted")
                if time.monotonic() > deadline:
                    raise EngineStartError(f"{who}engine core did not become ready within {self.start_timeout:.0f}s")
        info = self.engine_info = self._replicas[0].info
        self.max_model_len = min(r.info.max_model_len for r in self._replicas)
        self.vocab_size = info.vocab_size
        from tinyvllm.engine.tokenizer import eos_token_ids

        self.eos_token_ids = eos_token_ids(self.tokenizer, types.SimpleNamespace(eos_token_id=info.eos_token_id))
        for r in self._replicas:
            r.stats = SchedulerStats(kv_blocks_total=r.info.num_kv_blocks)
            self.metrics.update_from_stats(r.stats, engine=r.index)
        self._refresh_stats()
        if dp > 1:
            from tinyvllm.engine.data_parallel import DPRouter

            pc = self.config.parallel_config
            self.router = DPRouter(dp, info.block_size, [r.info.num_kv_blocks for r in self._replicas],
                                   pc.data_parallel_routing, self.config.cache_config.enable_prefix_caching)
        self._accepting = True
        for r in self._replicas:
            r.task = asyncio.create_task(self._output_loop(r), name=f"tinyvllm-output-loop-{r.index}")
        logger.info("engine core ready: max_model_len %d, %d KV blocks x %d tokens%s", self.max_model_len,
                    info.num_kv_blocks, info.block_size,
                    f" per replica, {dp} replicas (routing: {self.config.parallel_config.data_parallel_routing})"
                    if dp > 1 else "")

    def begin_shutdown(self, reason: str = "the server is shutting down") -> None:
        """Stop accepting requests and end every in-flight request with :class:`EngineShutdownError`."""
        self._accepting = False
        self._fail_all(EngineShutdownError(reason))

    async def shutdown(self, timeout: float = 5.0) -> None:
        """End in-flight requests, stop the output task(s), stop the core process(es) (join, then kill)."""
        for r in self._replicas:
            if r.task is not None:
                r.task.cancel()
                try:
                    await r.task
                except BaseException:  # noqa: BLE001 - cancelled or already failed
                    pass
                r.task = None
        self.begin_shutdown()
        await asyncio.to_thread(self._stop_process, timeout)
        self._close_sockets()

    def close(self, timeout: float = 5.0) -> None:
        """Synchronous shutdown (no event loop needed): stop the core process(es), close sockets. Idempotent."""
        self._accepting = False
        self._stop_process(timeout)
        self._close_sockets()

    def _stop_process(self, timeout: float) -> None:
        """Tell every core to exit and join them; terminate, then kill, any that does not."""
        if self._stopped or not self._launched:
            return
        self._stopped = True
        live = [r for r in self._replicas if r.proc is not None]
        for r in live:  # all told first: the replicas stop in parallel
            if r.proc.is_alive():
                if r.info is not None:
                    self._send(EngineCoreRequestType.SHUTDOWN, b"", raise_if_dead=False, replica=r.index)
                else:  # still loading: it reads no messages yet
                    r.proc.terminate()
        deadline = time.monotonic() + timeout
        for r in live:
            proc = r.proc
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                logger.warning("engine core %d did not exit in %.1fs; terminating", proc.pid, timeout)
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join(2.0)
            logger.info("engine core process %d exited (code %s)", proc.pid, proc.exitcode)

    def _close_sockets(self) -> None:
        for r in self._replicas:
            for sock in (r.in_sock, r.out_sock):
                if sock is not None:
                    sock.close(0)
            r.in_sock = r.out_sock = None
        for ctx in (self._sync_ctx, self._async_ctx):
            if ctx is not None:
                ctx.term()
        self._sync_ctx = self._async_ctx = None
        if self._tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)
            self._tmpdir = None

    # ------------------------------------------------------------------ requests
    def _send(self, kind: EngineCoreRequestType, payload: Any, raise_if_dead: bool = True, replica: int = 0) -> None:
        data = payload if isinstance(payload, bytes) else encode(payload)
        sock = self._replicas[replica].in_sock
        try:
            if sock is None:
                raise zmq.Again()
            sock.send_multipart([kind.value, data], flags=zmq.NOBLOCK)
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
        """Sequences waiting in the core(s) (last snapshot) plus those sent since each core last reported."""
        if self.data_parallel_size == 1:
            in_transit = self._num_sent - self.stats.num_added
            return self.stats.num_waiting + max(0, in_transit)
        return sum(r.stats.num_waiting + max(0, r.num_sent - r.stats.num_added) for r in self._replicas)

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
                    user: str | None = None, data_parallel_rank: int | None = None) -> RequestStream:
        """Validate (unless ``checked``: the caller ran :meth:`check_request`), admit and send a request
        to the core; returns the stream of its delta outputs. ``prefix_cache_debug`` asks the core for a
        prefix-cache report; ``user`` labels the request's KV cost in ``/metrics``; ``data_parallel_rank``
        sends it to that replica (vLLM's ``X-data-parallel-rank``) instead of the router's choice.

        Raises:
            InvalidRequestError: see :meth:`check_request`; a ``data_parallel_rank`` out of range.
            EngineOverloadedError, EngineShutdownError, EngineDeadError: see :meth:`check_admission`.
        """
        if not checked:
            self.check_request(prompt_token_ids, params)
        self.check_admission()
        if request_id in self._queues:
            raise InvalidRequestError(f"duplicate request id {request_id!r}", "request_id")
        dp = self.data_parallel_size
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < dp:
            raise InvalidRequestError(f"data_parallel_rank {data_parallel_rank} is not in 0..{dp - 1} "
                                      "(X-data-parallel-rank)", "data_parallel_rank")
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
        replica = 0
        if self.router is not None:
            replica = self.router.route(request_id, prompt_token_ids, params.cache_salt, data_parallel_rank)
        self.processor.add_request(request_id, prompt, prompt_token_ids, params, arrival)
        self._queues[request_id] = queue
        self.metrics.request_added(request_id, arrival, user)
        try:
            self._send(EngineCoreRequestType.ADD, payload, replica=replica)
        except BaseException:  # whatever fails after registration unregisters the request
            self._forget(request_id)
            self.processor.abort_request(request_id)
            if self.router is not None:
                self.router.finish(request_id)
            raise
        self._num_sent += len(reqs)
        if dp > 1:
            self._replicas[replica].num_sent += len(reqs)
        return RequestStream(self, request_id, queue)

    def _release_replica(self, request_id: str) -> int:
        """Drop the request from the router (its load); returns its replica (0 without data parallelism)."""
        if self.router is None:
            return 0
        r = self.router.finish(request_id)
        return 0 if r is None else r

    def abort(self, request_id: str) -> None:
        """Forget a request and abort its unfinished samples in its core (KV blocks freed next loop)."""
        self._forget(request_id)
        kids = self.processor.abort_request(request_id)
        replica = self._release_replica(request_id)
        if kids:
            self._send(EngineCoreRequestType.ABORT, kids, raise_if_dead=False, replica=replica)

    def _forget(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self.metrics.request_aborted(request_id)

    def tracked_state(self) -> dict[str, int]:
        """What this process and (as of their last reports) the engine core(s) hold: ``api_streams`` (request
        queues), ``api_output_requests`` / ``api_output_samples`` (output processor), ``api_metrics_requests``
        (per-request timing state), ``core_running`` / ``core_waiting`` (sequences) and ``core_kv_blocks_used``
        (summed over the replicas); with data parallelism also ``api_routed_requests`` (the router's) and
        ``replica<i>_core_running`` / ``_core_waiting`` / ``_core_kv_blocks_used`` per replica.
        All zero on an idle server that leaks nothing."""
        state = {"api_streams": len(self._queues), "api_output_requests": len(self.processor.requests),
                 "api_output_samples": len(self.processor.child_to_parent),
                 "api_metrics_requests": self.metrics.num_tracked_requests,
                 "core_running": self.stats.num_running, "core_waiting": self.stats.num_waiting,
                 "core_kv_blocks_used": self.stats.kv_blocks_used}
        if self.data_parallel_size > 1:
            state["api_routed_requests"] = len(self.router.requests) if self.router is not None else 0
            for r in self._replicas:
                state[f"replica{r.index}_core_running"] = r.stats.num_running
                state[f"replica{r.index}_core_waiting"] = r.stats.num_waiting
                state[f"replica{r.index}_core_kv_blocks_used"] = r.stats.kv_blocks_used
        return state

    def replica_stats(self) -> list[dict[str, Any]]:
        """Per replica: its engine core's pid, its last :class:`SchedulerStats` and the router's counts
        (``routed_requests``, ``outstanding_requests``, ``predicted_hit_blocks``...)."""
        out = []
        for r in self._replicas:
            d: dict[str, Any] = {"replica": r.index, "engine_core_pid": r.proc.pid if r.proc else None,
                                 **r.stats.as_dict()}
            if self.router is not None:
                d.update(self.router.state(r.index))
            out.append(d)
        return out

    def reset_prefix_cache(self) -> None:
        for r in self._replicas:
            self._send(EngineCoreRequestType.RESET_PREFIX_CACHE, b"", replica=r.index)
        if self.router is not None:
            self.router.reset()

    def _fail_all(self, err: BaseException) -> None:
        kids: dict[int, list[str]] = {}
        for rid in list(self._queues):
            self._queues[rid].put_nowait(err)
            kids.setdefault(self._release_replica(rid), []).extend(self.processor.abort_request(rid))
        if self._dead is None:
            for replica, ids in kids.items():
                if ids:
                    self._send(EngineCoreRequestType.ABORT, ids, raise_if_dead=False, replica=replica)

    # ------------------------------------------------------------------ output loop
    async def _output_loop(self, r: _Replica) -> None:
        assert r.out_sock is not None and r.proc is not None
        who = f"{r.name} (pid {r.proc.pid}): " if self.data_parallel_size > 1 else ""
        try:
            while True:
                if not await r.out_sock.poll(1000):
                    if not r.proc.is_alive():
                        raise EngineDeadError(f"{who}the engine core process died (exit code {r.proc.exitcode})")
                    continue
                tag, payload = await r.out_sock.recv_multipart()
                if tag == OUTPUTS_TAG:
                    self._handle_outputs(self._output_decoder.decode(payload), r)
                elif tag == ERROR_TAG:
                    raise EngineDeadError(f"{who}the engine core failed: {self._error_decoder.decode(payload).message}")
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001
            if self._dead is not None:  # another replica's death already failed everything
                return
            logger.error("engine output loop stopped: %s", e, exc_info=not isinstance(e, EngineDeadError))
            self._dead = e if isinstance(e, EngineDeadError) else EngineDeadError(str(e))
            self._accepting = False
            self._fail_all(self._dead)
            if self.on_dead is not None:
                self.on_dead(self._dead)

    def _refresh_stats(self) -> None:
        if self.data_parallel_size == 1:
            self.stats = self._replicas[0].stats
        else:
            from tinyvllm.engine.data_parallel import sum_stats

            self.stats = sum_stats([r.stats for r in self._replicas])

    def _handle_outputs(self, msg: EngineCoreOutputs, r: _Replica | None = None) -> None:
        now = time.monotonic()
        r = r if r is not None else self._replicas[0]
        dp = self.data_parallel_size
        if msg.scheduler_stats is not None:
            r.stats = msg.scheduler_stats
            self._refresh_stats()
            self.metrics.update_from_stats(msg.scheduler_stats, engine=r.index)
        for cid, err in msg.rejected:
            parent = self.processor.child_to_parent.get(cid)
            if parent is None:
                continue
            queue = self._queues.get(parent)
            self.abort(parent)
            if queue is not None:
                queue.put_nowait(InvalidRequestError(err))
        if dp > 1:  # listeners (the dashboard) see the whole engine's stats; the block map of replica 0 only
            it = msg.iteration_stats
            if it is not None and r.index > 0 and it.kv_block_map:
                it = msgspec.structs.replace(it, kv_block_map=b"")
            msg = msgspec.structs.replace(msg, scheduler_stats=self.stats if msg.scheduler_stats else None,
                                          iteration_stats=it)
        if not msg.outputs:
            if self.step_listeners:
                self._notify(msg, [])
            return
        outs, to_abort = self.processor.process_outputs(msg.outputs, delta=True)
        if to_abort:  # stop strings matched here; free the samples' KV in the core
            self._send(EngineCoreRequestType.ABORT, to_abort, raise_if_dead=False, replica=r.index)
        for out in outs:
            self.metrics.record_output(out, now)
            if self.router is not None:
                self.router.prefill_done(out.request_id)
                if out.finished:
                    self.router.finish(out.request_id)
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
