"""Grammars of the running requests: compiled off the step loop, advanced token by token, and the
step's token bitmask.

:class:`StructuredOutputManager` lives in the engine core. ``grammar_for`` starts compiling a
request's constraint in a background thread (one per engine; a cache of futures keyed by
``(kind, spec)`` shares a compile between requests, the ``n`` samples of one request among them);
the request waits in the queue as ``WAITING_FOR_FSM`` and the step loop keeps running the others.
Each step :meth:`StructuredOutputManager.fill_bitmask` writes, for the scheduled rows that sample
this step (a decode, or a prefill whose last chunk this is), the next-token bitmask of their
grammar into the :class:`~tinyvllm.scheduler_output.SchedulerOutput`; the scheduler advances each
grammar with the token sampled (:meth:`RequestGrammar.accept_token`). Shapes as in vLLM v1's
``structured_output/`` (``StructuredOutputManager.grammar_bitmask``).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Mapping, Sequence

import numpy as np

from tinyvllm.sampling_params import StructuredOutputsParams
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.structured_output.backend_xgrammar import BackendFactory, XgrammarBackend

logger = logging.getLogger("tinyvllm")


class RequestGrammar:
    """One request's grammar state: the compile (a future) and, once compiled, its matcher.

    The matcher has accepted exactly ``num_accepted`` tokens, which are the request's output tokens
    so far. Recompute preemption keeps a request's output tokens, so the matcher stays valid across
    a preemption; :meth:`sync` rebuilds it from the output should the two ever disagree.
    """

    def __init__(self, manager: StructuredOutputManager, future: Future, stop_token_ids: Sequence[int]) -> None:
        self._manager = manager
        self._future = future
        self._stop = list(stop_token_ids)
        self._matcher: Any = None
        self.num_accepted = 0

    @property
    def ready(self) -> bool:
        """The compile has finished (successfully or not)."""
        return self._future.done()

    def wait(self, timeout: float) -> None:
        """Block until the compile is done or ``timeout`` seconds pass."""
        try:
            self._future.exception(timeout)
        except Exception:  # noqa: BLE001 - a timeout or a cancelled compile: the caller checks ready
            pass

    @property
    def error(self) -> BaseException | None:
        """The compile's exception once :attr:`ready`, else None."""
        return self._future.exception() if self._future.done() else None

    @property
    def matcher(self) -> Any:
        if self._matcher is None:
            self._matcher = self._manager.backend.matcher(self._future.result(), self._stop)
        return self._matcher

    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False if the grammar rejects it (the matcher is unchanged)."""
        ok = bool(self.matcher.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok

    def is_terminated(self) -> bool:
        """The grammar has accepted a stop token: the request is done."""
        return bool(self.matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        self.matcher.rollback(num_tokens)
        self.num_accepted -= num_tokens

    def sync(self, output_token_ids: Sequence[int]) -> None:
        """Make the matcher's state that of ``output_token_ids`` (rolled back or rebuilt if they differ)."""
        n = len(output_token_ids)
        if self.num_accepted == n:
            return
        if self.num_accepted > n:
            self.rollback(self.num_accepted - n)
            return
        for t in output_token_ids[self.num_accepted:]:
            if not self.accept_token(t):
                break

    def fill_bitmask(self, bitmask: np.ndarray, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


def lower_thread_priority(nice: int) -> int | None:
    """Raise the calling thread's nice value by ``nice`` (Linux: a thread id is a ``PRIO_PROCESS`` target).

    The compile thread runs at a lower priority than the engine's step loop and its OpenMP threads,
    so on a machine with as many cores as engine threads a compile takes the cycles the engine leaves
    idle instead of descheduling one thread of a parallel region (which stalls the whole region at
    its barrier). Returns the thread's new nice value, or None where this is not supported.
    """
    if nice <= 0 or not hasattr(os, "setpriority"):
        return None
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + nice))
        return os.getpriority(os.PRIO_PROCESS, tid)
    except OSError as e:  # not permitted, or not Linux semantics: compile at normal priority
        logger.debug("grammar compile thread keeps its priority: %s", e)
        return None


def use_idle_scheduling() -> bool:
    """Put the calling thread in Linux's ``SCHED_IDLE`` class; returns whether it is there now.

    A nice value alone is not enough on an EEVDF kernel (Linux 6.6+): a woken OpenMP worker of the
    engine can wait for the nice-19 compile thread's slice to run out (milliseconds) before it gets
    its core back, and a step's parallel regions pay that at every barrier. A ``SCHED_IDLE`` thread
    is preempted at once by any normal thread that wakes (``check_preempt_wakeup_fair`` in the
    kernel's ``fair.c``), so the compile only ever uses cycles the engine leaves idle.
    """
    if not hasattr(os, "sched_setscheduler") or not hasattr(os, "SCHED_IDLE"):
        return False
    try:
        tid = threading.get_native_id()  # Linux: a thread id is a valid sched_setscheduler target
        os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
        return os.sched_getscheduler(tid) == os.SCHED_IDLE
    except OSError as e:
        logger.debug("grammar compile thread keeps its scheduling class: %s", e)
        return False


class StructuredOutputManager:
    """Compiles constraints in a background thread and builds each step's bitmask.

    Args:
        backend_factory: builds the :class:`XgrammarBackend` (loads the tokenizer); called once, in
            the compile thread, at the first constrained request.
        max_cached_grammars: compiled grammars kept for reuse (least recently used dropped first).
        compile_nice: added to the compile thread's nice value (``TINYVLLM_GRAMMAR_COMPILE_NICE``,
            19 by default; 0 keeps the engine's priority). See :func:`lower_thread_priority`.
        compile_sched_idle: also put the compile thread in ``SCHED_IDLE``
            (``TINYVLLM_GRAMMAR_COMPILE_SCHED``: ``normal``, the default, or ``idle``). See
            :func:`use_idle_scheduling`.
    """

    def __init__(self, backend_factory: BackendFactory, max_cached_grammars: int = 256,
                 compile_nice: int | None = None, compile_sched_idle: bool | None = None) -> None:
        from tinyvllm import envs

        self.compile_nice = envs.TINYVLLM_GRAMMAR_COMPILE_NICE if compile_nice is None else compile_nice
        self.compile_sched_idle = (envs.TINYVLLM_GRAMMAR_COMPILE_SCHED == "idle" if compile_sched_idle is None
                                   else compile_sched_idle)
        self.compile_thread_nice: int | None = None  # the compile thread's nice value once it started
        self.compile_thread_idle = False  # whether the compile thread runs in SCHED_IDLE
        self._factory = backend_factory
        self._backend: XgrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self._executor: ThreadPoolExecutor | None = None
        self._cache: dict[tuple[str, str], Future] = {}  # insertion order = least recently used first
        self._max_cached = max_cached_grammars
        self.num_compiles = 0

    @property
    def backend(self) -> XgrammarBackend:
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._factory()
            return self._backend

    def _init_compile_thread(self) -> None:
        self.compile_thread_nice = lower_thread_priority(self.compile_nice)
        self.compile_thread_idle = self.compile_sched_idle and use_idle_scheduling()

    def _compile(self, so: StructuredOutputsParams) -> Any:
        self.num_compiles += 1
        return self.backend.compile(so)

    def grammar_for(self, so: StructuredOutputsParams, stop_token_ids: Sequence[int]) -> RequestGrammar:
        """Start (or share) the compile of ``so``; returns the request's grammar state at once."""
        key = so.key
        fut = self._cache.pop(key, None)
        if fut is None or (fut.done() and fut.exception() is not None):
            if self._executor is None:
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="tinyvllm-grammar",
                                                    initializer=self._init_compile_thread)
            fut = self._executor.submit(self._compile, so)
        self._cache[key] = fut
        while len(self._cache) > self._max_cached:  # requests keep their own reference to theirs
            self._cache.pop(next(iter(self._cache)))
        return RequestGrammar(self, fut, stop_token_ids)

    def fill_bitmask(self, sched: SchedulerOutput, requests: Mapping[str, Any]) -> None:
        """Set ``sched.structured_output_request_ids`` and ``sched.grammar_bitmask`` for this step.

        A row is included when the request has a grammar and its step reaches the end of its known
        tokens (``num_computed_tokens + num_scheduled == num_tokens``), i.e. it samples this step.
        The bitmask is int32 ``[rows, ceil(vocab_size / 32)]``, C order, as bytes.
        """
        rows: list[tuple[str, Any, list[int]]] = []
        spec = sched.scheduled_spec_decode_tokens
        for rid, num_new in sched.num_scheduled_tokens.items():
            req = requests.get(rid)
            g = getattr(req, "grammar", None)
            drafts = spec.get(rid, []) if spec else []
            if g is None or req.num_computed_tokens + num_new - len(drafts) != req.num_tokens:
                continue
            rows.append((rid, req, drafts))
        if not rows:
            return
        words = (self.backend.vocab_size + 31) // 32
        bitmask = np.full((sum(len(d) + 1 for _, _, d in rows), words), -1, dtype=np.int32)
        ids: list[str] = []
        for rid, req, drafts in rows:
            # Speculative decoding: one row per verified position, the grammar advanced through the
            # drafts before it (the drafter kept only drafts the grammar accepts), then rolled back.
            g = req.grammar
            g.sync(req.output_token_ids)
            g.fill_bitmask(bitmask, len(ids))
            ids.append(rid)
            advanced, ok = 0, True
            for t in drafts:
                ok = ok and not g.is_terminated() and g.accept_token(t)
                if ok:
                    advanced += 1
                    g.fill_bitmask(bitmask, len(ids))
                else:  # (never: drafts are validated) the rows after a forbidden draft are not used
                    bitmask[len(ids)] = bitmask[len(ids) - 1]
                ids.append(rid)
            if advanced:
                g.rollback(advanced)
        sched.structured_output_request_ids = ids
        sched.grammar_bitmask = bitmask.tobytes()

    def shutdown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
