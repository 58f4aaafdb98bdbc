"""EngineCore: the loop ``schedule -> execute -> update`` over token ids (no text).

It owns the scheduler (with the KV cache manager) and an executor (which owns
the worker(s): weights, KV tensors, per-request sampling state). The front end
(offline :class:`~tinyvllm.LLM` or the API server) sends
:class:`~tinyvllm.engine.messages.EngineCoreRequest` and receives
:class:`~tinyvllm.engine.messages.EngineCoreOutput` per step; text, stop strings
and streaming live there.

Where round 2's pieces plug in: a KV connector's scheduler half is consulted by
the scheduler (tokens from outside, delayed frees); a structured-output manager
advances grammars in :meth:`step` after ``update_from_output`` and puts the
step's bitmask in the schedule; the dashboard reads the typed stats of
:meth:`make_stats` / :attr:`last_iteration`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from pathlib import Path

import torch

from tinyvllm.config import EngineConfig, resolve_device
from tinyvllm.core.kv_diagnostics import block_state_map
from tinyvllm.core.kv_offload import OffloadIndex
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.input_processor import check_prompt
from tinyvllm.engine.messages import EngineCoreOutput, EngineCoreRequest
from tinyvllm.executor import get_executor_class
from tinyvllm.metrics.stats import IterationStats, SchedulerStats
from tinyvllm.model.loader import ResolvedModel, resolve_model
from tinyvllm.request import Request, RequestStatus
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.spec_decode.drafter import Drafter
from tinyvllm.structured_output import StructuredOutputManager, XgrammarBackend

# The KV block map (one byte per block) rides on a step's IterationStats at most this often (seconds).
BLOCK_MAP_INTERVAL_S = 0.5

logger = logging.getLogger("tinyvllm")


def check_parallel(config: EngineConfig, device: torch.device, model_dir: "str | Path") -> None:
    """Refuse a tensor-parallel size the model or the machine cannot run (one line).

    Raises:
        ValueError: the heads (or MLP) cannot be split over the ranks; more ranks per node than GPUs (CUDA)
            or CPU cores (each rank needs at least one); a KV connector or disk KV tier (not supported with TP).
    """
    import json
    import os

    from tinyvllm.model.tensor_parallel import check_tensor_parallel

    pc, cc = config.parallel_config, config.cache_config
    tp, per_node = pc.tensor_parallel_size, len(pc.pipe_ranks())
    if cc.kv_transfer_config is not None:
        raise ValueError("--kv-transfer-config (prefill/decode disaggregation) is not supported with "
                         "--tensor-parallel-size > 1 yet")
    if cc.kv_offload_path is not None:
        raise ValueError("--kv-offload-path (the disk KV tier) is not supported with --tensor-parallel-size > 1 "
                         "yet; the host-memory tier (--kv-offload-size alone) is")
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    check_tensor_parallel(cfg.get("text_config", cfg) if "num_attention_heads" not in cfg else cfg, tp)
    if device.type == "cuda" and per_node > torch.cuda.device_count():
        raise ValueError(f"tensor_parallel_size {tp} needs {per_node} GPUs on this node, "
                         f"{torch.cuda.device_count()} visible")
    if device.type == "cpu" and per_node > (os.cpu_count() or 1):
        raise ValueError(f"tensor_parallel_size {tp} puts {per_node} ranks on this node's "
                         f"{os.cpu_count()} CPU cores (one rank per core at least)")


class EngineCore:
    """Scheduler + executor, driven one step at a time."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None,
                 model: "torch.nn.Module | None" = None) -> None:
        """Load the model (or reuse ``model``, already loaded in the right dtype) and size the KV cache.

        Raises:
            ModelNotFoundError: the model cannot be found.
            ValueError: ``max_model_len`` beyond the model's positions; CUDA asked for but unavailable.
        """
        mc, cc = config.model_config, config.cache_config
        self.device = resolve_device(mc.device)  # "auto" -> cuda if available, else cpu
        config = dataclasses.replace(config, model_config=dataclasses.replace(mc, device=str(self.device)))
        mc = config.model_config
        self.config = config
        self.resolved = resolved or resolve_model(mc.model, mc.load_format)
        torch.manual_seed(mc.seed)
        t0 = time.monotonic()
        self.dtype = mc.torch_dtype
        if config.parallel_config.tensor_parallel_size > 1:  # a bad split is one line here, before any rank starts
            check_parallel(config, self.device, self.resolved.model_dir)
        self.model_executor = get_executor_class(config)(config, self.device, self.resolved.model_dir, model)
        info = self.model_info = self.model_executor.model_info()
        if mc.max_model_len is not None and mc.max_model_len > info.max_position_embeddings:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds the model's max_position_embeddings "
                             f"{info.max_position_embeddings}")
        self.max_model_len = mc.max_model_len or info.max_position_embeddings
        bytes_per_block = info.kv_bytes_per_token * cc.block_size
        num_blocks = cc.num_kv_blocks or max(1, int(cc.kv_cache_memory) // bytes_per_block)
        self.num_blocks = num_blocks
        self.kv_capacity_tokens = num_blocks * cc.block_size
        if self.max_model_len > self.kv_capacity_tokens:
            logger.warning("max_model_len %d exceeds the KV cache capacity of %d tokens; lowering it to %d",
                           self.max_model_len, self.kv_capacity_tokens, self.kv_capacity_tokens)
            self.max_model_len = self.kv_capacity_tokens
        sc = config.scheduler_config
        if not sc.enable_chunked_prefill and sc.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"with chunked prefill disabled, max_num_batched_tokens ({sc.max_num_batched_tokens}) "
                             f"must be >= max_model_len ({self.max_model_len})")
        self.model_executor.initialize_kv_cache(num_blocks, self.max_model_len)
        offload = None
        if cc.kv_offload_size:
            num_slots = cc.kv_offload_size // bytes_per_block
            if num_slots < 1:
                raise ValueError(f"kv_offload_size {cc.kv_offload_size} B holds no KV block "
                                 f"({bytes_per_block} B each)")
            entries = self.model_executor.initialize_kv_offload(num_slots, cc.kv_offload_path)
            offload = OffloadIndex(num_slots, entries, store_on_free=cc.kv_offload_path is not None)
            logger.info("KV offload tier: %d blocks (%.2f GiB) in %s%s", num_slots,
                        num_slots * bytes_per_block / 2**30, cc.kv_offload_path or "host memory",
                        f", {len(entries)} blocks from a previous run" if entries else "")
        connector = None
        if cc.kv_transfer_config is not None:  # P/D disaggregation: the worker half first (it binds the port)
            from tinyvllm.distributed.kv_transfer import KVConnectorRole, create_kv_connector

            kvt = cc.kv_transfer_config
            engine_id = kvt.engine_id or uuid.uuid4().hex
            handshake = self.model_executor.initialize_kv_connector(engine_id)
            connector = create_kv_connector(kvt, KVConnectorRole.SCHEDULER,
                                            {"block_size": cc.block_size, "engine_id": engine_id, **handshake})
        self.scheduler = Scheduler(config.scheduler_config, cc, num_blocks, self.max_model_len, offload=offload,
                                   connector=connector)
        self.kv_transfers_changed = False  # the last step completed a KV transfer (freed or landed blocks)
        self.kv_event_publisher = None
        if cc.kv_events_config is not None and cc.kv_events_config.enabled:
            from tinyvllm.distributed.kv_events import ZmqEventPublisher

            self.kv_event_publisher = ZmqEventPublisher(cc.kv_events_config)
            self.scheduler.kv.block_pool.kv_events = []
        self.last_step_idle = False  # the last step ran nothing and changed nothing (waiting on transfers)
        # Grammars compile in a background thread; the tokenizer is loaded there at the first
        # constrained request (tests with a raw vocabulary replace the manager).
        model_dir, vocab_size = self.resolved.model_dir, info.vocab_size

        def _backend() -> XgrammarBackend:
            from tinyvllm.engine.tokenizer import load_tokenizer

            return XgrammarBackend.from_hf_tokenizer(load_tokenizer(model_dir), vocab_size)

        self.structured_output_manager = StructuredOutputManager(_backend)
        self.drafter = Drafter(config.speculative_config) if config.speculative_config is not None else None
        self.load_seconds = time.monotonic() - t0
        logger.info(
            "model %s (%s, %s%s) loaded in %.1fs; KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s)",
            self.resolved.served_name, str(self.dtype).replace("torch.", ""), self.device,
            ", CUDA graphs" if getattr(self.runner, "graph_runner", None) is not None else "", self.load_seconds,
            num_blocks, cc.block_size, self.kv_capacity_tokens, num_blocks * bytes_per_block / 2**30,
            "prefix caching on" if cc.enable_prefix_caching else "prefix caching off",
        )
        self.last_iteration = IterationStats()
        self._last_block_map = -BLOCK_MAP_INTERVAL_S

    def shutdown(self) -> None:
        """Stop the executor's workers (tensor-parallel rank processes; in-process: nothing)."""
        self.model_executor.shutdown()

    @property
    def model(self) -> torch.nn.Module:
        """The loaded model (uniprocess executor; tests share its weights between engines). With tensor
        parallelism, a stand-in with the model's ``config`` and ``quantization`` (the weights live in the ranks)."""
        ex = self.model_executor
        return ex.worker.model if hasattr(ex, "worker") else ex.model_stub

    @property
    def runner(self):  # noqa: ANN201 - ModelRunner; uniprocess executor, for tests and benchmarks
        """The worker's model runner (uniprocess executor; tests and benchmarks inspect it; None with tensor
        parallelism)."""
        ex = self.model_executor
        return ex.worker.model_runner if hasattr(ex, "worker") else None

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: see :func:`~tinyvllm.engine.input_processor.check_prompt`; a duplicate id.
        """
        sp = req.sampling_params
        check_prompt(req.prompt_token_ids, sp, self.max_model_len, self.model_info.vocab_size)
        n = len(req.prompt_token_ids)
        max_tokens = self.max_model_len - n if sp.max_tokens is None else min(sp.max_tokens, self.max_model_len - n)
        request = Request(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling_params=sp,
            eos_token_ids=frozenset(req.eos_token_ids), max_tokens=max_tokens,
            arrival_time=req.arrival_time or time.monotonic(), prefix_cache_debug=req.prefix_cache_debug,
            cache_salt=sp.cache_salt,
        )
        if sp.structured_outputs is not None:
            request.grammar = self.structured_output_manager.grammar_for(sp.structured_outputs, req.eos_token_ids)
            request.status = RequestStatus.WAITING_FOR_FSM
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)
        self._flush_kv_offload()

    def _flush_kv_offload(self) -> None:
        """Run the offload copies prepared outside ``schedule()`` (a disk tier's stores of the requests
        freed by this step's finishes or by an abort) now, in a schedule that carries only them, so
        that they reach the tier even if no step follows."""
        stores, loads = self.scheduler.kv.take_offload_ops()
        if stores or loads:
            self.model_executor.execute_model(SchedulerOutput(kv_offload_stores=stores, kv_offload_loads=loads))

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_pending_kv_transfers(self) -> bool:
        """True while a KV connector moves blocks (steps must run to complete them, even with no request)."""
        return self.scheduler.has_pending_kv_transfers()

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, update requests; return per-request new tokens and finishes."""
        t0 = time.perf_counter()
        outputs: list[EngineCoreOutput] = self._check_compiled_grammars()
        sched = self.scheduler.schedule()
        if not sched.is_empty:
            self.structured_output_manager.fill_bitmask(sched, self.scheduler.requests)
        elif not outputs:
            # Nothing to run but grammars compiling: wait for one (a few ms at most) rather than spin,
            # so the compile thread gets the CPU and the busy loop does not flood the front end.
            pending = [r.grammar for r in self.scheduler.waiting if r.status == RequestStatus.WAITING_FOR_FSM]
            if pending:
                pending[0].wait(0.005)
        self.kv_transfers_changed = False
        self.last_step_idle = sched.is_empty and not outputs and not sched.finished_req_ids
        if (not sched.is_empty or sched.finished_req_ids  # an empty schedule may still carry finishes
                or sched.kv_connector_metadata or self.scheduler.has_pending_kv_transfers()):
            t_exec = time.perf_counter()
            result = self.model_executor.execute_model(sched)
            t_exec = time.perf_counter() - t_exec
            self.kv_transfers_changed = self.scheduler.update_from_kv_xfer_finished(result.kv_connector_output)
            self.last_step_idle = self.last_step_idle and not self.kv_transfers_changed
            touched = self.scheduler.update_from_output(sched, result.sampled, result.spec_accepted)
            for req in touched:
                lp = result.logprobs.get(req.request_id)
                n = req.num_new_output_tokens  # more than one when drafts were accepted
                if lp is not None and n > 1:
                    lps = (result.spec_logprobs.get(req.request_id, []) + [lp])[:n]
                else:
                    lps = [lp] if lp is not None else None
                outputs.append(EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=req.output_token_ids[-n:] if n > 1 else [req.output_token_ids[-1]],
                    new_logprobs=lps,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                    kv_block_seconds=req.kv_block_seconds,
                    peak_kv_blocks=req.peak_num_blocks,
                    num_prefill_computed=req.num_prefill_computed,
                    num_prefill_cached=req.num_prefill_cached,
                    prefix_cache=req.prefix_cache_report if req.num_output_tokens == 1 else None,
                    prompt_logprobs=result.prompt_logprobs.get(req.request_id),
                    num_cached_tokens_tier=req.num_cached_tokens_tier,
                    kv_transfer_params=req.kv_transfer_params_out,
                ))
            if self.drafter is not None:
                self._speculate(sched, result, touched, t_exec)
        self._flush_kv_offload()
        self._publish_kv_events()
        t1 = time.perf_counter()
        block_map = b""
        if t1 - self._last_block_map >= BLOCK_MAP_INTERVAL_S or not self.scheduler.has_unfinished_requests():
            self._last_block_map = t1
            block_map = block_state_map(self.scheduler.kv.block_pool)
        self.last_iteration = IterationStats(
            num_prefill_tokens=sched.num_prefill_tokens, num_decode_tokens=sched.num_decode_tokens,
            num_scheduled_reqs=len(sched.num_scheduled_tokens), num_preempted_reqs=len(sched.preempted_req_ids),
            step_seconds=t1 - t0, token_budget=self.scheduler.config.max_num_batched_tokens,
            kv_block_map=block_map)
        return outputs

    def _speculate(self, sched: SchedulerOutput, result, touched: list[Request], exec_seconds: float) -> None:
        """Speculative decoding between steps: learn from this step (its time when it computed no
        prefill; its verifications always), then propose the next step's drafts for the running requests."""
        drafter = self.drafter
        for req in touched:
            if req.status.is_finished:
                drafter.finish(req)
        if sched.num_scheduled_tokens:  # the step time model is fitted to steps without prefill only
            drafter.observe(sched.total_num_scheduled_tokens if sched.num_prefill_tokens == 0 else 0, exec_seconds,
                            sched.scheduled_spec_decode_tokens, result.spec_accepted)
        sch = self.scheduler
        budget = sch.config.max_num_batched_tokens
        base = sum(r.num_tokens - r.num_computed_tokens for r in sch.running)
        if sch.waiting and len(sch.running) < sch.config.max_num_seqs:
            base += sch.waiting[0].num_tokens
        sch.stats.spec_decode_propose_seconds += drafter.propose(sch.running, min(base, budget))
    def _publish_kv_events(self) -> None:
        """Publish the prefix cache's changes since the last call (``--kv-events-config``)."""
        pool = self.scheduler.kv.block_pool
        if self.kv_event_publisher is not None and pool.kv_events:
            from tinyvllm.distributed.kv_events import to_events

            raw, pool.kv_events = pool.kv_events, []
            self.kv_event_publisher.publish(to_events(raw, self.scheduler.block_size))

    def _check_compiled_grammars(self) -> list[EngineCoreOutput]:
        """Requests whose grammar finished compiling become schedulable; a failed compile (the API
        validates first, so only an offline caller sees one) finishes the request as aborted."""
        failed: list[EngineCoreOutput] = []
        for req in [r for r in self.scheduler.waiting if r.status == RequestStatus.WAITING_FOR_FSM]:
            if not req.grammar.ready:
                continue
            if req.grammar.error is None:
                req.status = RequestStatus.WAITING
                continue
            logger.error("request %s: grammar compile failed: %s", req.request_id, req.grammar.error)
            self.scheduler.abort_requests([req.request_id])
            failed.append(EngineCoreOutput(request_id=req.request_id, new_token_ids=[], finish_reason="abort",
                                           num_prompt_tokens=req.num_prompt_tokens))
        return failed

    def make_stats(self) -> SchedulerStats:
        """Typed snapshot: queue and KV gauges, cumulative token / preemption / prefix-cache counters."""
        st = self.scheduler.make_stats()
        tier = getattr(self.runner, "kv_offload", None) if hasattr(self.model_executor, "worker") else None
        if tier is not None:  # the worker's copy timer (uniprocess executor)
            st.kv_offload_block_bytes = tier.slot_bytes
            st.kv_offload_load_seconds = tier.load_seconds
        return st

    def stats(self) -> dict:
        """:meth:`make_stats` as a dict: ``num_steps``, ``prefill_tokens``, ``decode_tokens``,
        ``cached_prompt_tokens``, ``num_preemptions``, ``prefix_cache_queries`` / ``prefix_cache_hits``
        (tokens), ``num_running``, ``num_waiting``, ``kv_blocks_used``, ``kv_blocks_total``."""
        return self.make_stats().as_dict()

    def reset_prefix_cache(self) -> bool:
        ok = self.scheduler.kv.reset_prefix_cache()
        self._publish_kv_events()
        return ok
