"""EngineCore: the loop ``schedule -> execute -> update`` over token ids (no text).

It owns the scheduler (with the KV cache manager) and the model runner (with the
weights and KV tensors). The front end (offline :class:`~tinyvllm.LLM` or the
API server) sends :class:`EngineCoreRequest` and receives
:class:`EngineCoreOutput` per step; text, stop strings and streaming live there.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch

from tinyvllm import envs
from tinyvllm.config import EngineConfig, resolve_device
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.engine.request import Request
from tinyvllm.model.weights import load_model
from tinyvllm.model.loader import ResolvedModel, resolve_model
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.worker.model_runner import ModelRunner, TokenLogprobs

logger = logging.getLogger("tinyvllm")


class EngineCoreRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float = 0.0


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0


@dataclass
class EngineStepStats:
    """Per-step and cumulative engine statistics."""

    step_prefill_tokens: int = 0
    step_decode_tokens: int = 0
    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    kv_usage: float = 0.0
    step_seconds: float = 0.0
    cumulative: dict = field(default_factory=dict)


class EngineCore:
    """Scheduler + model runner, driven one step at a time."""

    def __init__(self, config: EngineConfig, resolved: ResolvedModel | None = None,
                 model: "torch.nn.Module | None" = None) -> None:
        """Load the model (or reuse ``model``, already loaded in the right dtype) and size the KV cache.

        Raises:
            ModelNotFoundError: the model cannot be found.
            ValueError: ``max_model_len`` beyond the model's positions; CUDA asked for but unavailable.
        """
        self.config = config
        mc, cc = config.model_config, config.cache_config
        self.device = resolve_device(mc.device)  # "auto" -> cuda if available, else cpu
        mc.device = str(self.device)
        self.resolved = resolved or resolve_model(mc.model, mc.load_format)
        torch.manual_seed(mc.seed)
        threads = envs.TINYVLLM_NUM_THREADS
        if threads > 0:
            torch.set_num_threads(threads)
        t0 = time.monotonic()
        self.dtype = mc.torch_dtype
        if model is None:
            model = load_model(self.resolved.model_dir, self.dtype, self.device, load_format=mc.load_format,
                               seed=mc.seed)
        self.model = model
        model_device = next(self.model.parameters()).device
        if model_device.type != self.device.type:
            raise ValueError(f"the preloaded model is on {model_device}, but the engine runs on {self.device}")
        mcfg = self.model.config
        if mc.max_model_len is not None and mc.max_model_len > mcfg.max_position_embeddings:
            raise ValueError(f"max_model_len {mc.max_model_len} exceeds the model's max_position_embeddings "
                             f"{mcfg.max_position_embeddings}")
        self.max_model_len = mc.max_model_len or mcfg.max_position_embeddings
        bytes_per_block = mcfg.kv_bytes_per_token(self.dtype) * cc.block_size
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
        self.runner = ModelRunner(self.model, num_blocks, cc.block_size, self.dtype, self.device,
                                  max_num_seqs=sc.max_num_seqs, max_model_len=self.max_model_len,
                                  enforce_eager=mc.enforce_eager)
        self.scheduler = Scheduler(config.scheduler_config, cc, num_blocks, self.max_model_len)
        self.load_seconds = time.monotonic() - t0
        logger.info(
            "model %s (%s, %s%s) loaded in %.1fs; KV cache: %d blocks x %d tokens = %d tokens (%.2f GiB, %s)",
            self.resolved.served_name, str(self.dtype).replace("torch.", ""), self.device,
            ", CUDA graphs" if self.runner.graph_runner is not None else "", self.load_seconds, num_blocks,
            cc.block_size, self.kv_capacity_tokens, num_blocks * bytes_per_block / 2**30,
            "prefix caching on" if cc.enable_prefix_caching else "prefix caching off",
        )
        self.last_stats = EngineStepStats()

    # ------------------------------------------------------------------ requests
    def add_request(self, req: EngineCoreRequest) -> None:
        """Queue a request.

        Raises:
            ValueError: empty prompt, a prompt that leaves no room in ``max_model_len``,
                a duplicate id, or token ids outside the vocabulary.
        """
        n = len(req.prompt_token_ids)
        if n == 0:
            raise ValueError("prompt must not be empty")
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt is {n} tokens, but max_model_len is {self.max_model_len}: it must be shorter "
                "to leave room for at least one generated token"
            )
        vocab = self.model.config.vocab_size
        if min(req.prompt_token_ids) < 0 or max(req.prompt_token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        sp = req.sampling_params
        max_tokens = self.max_model_len - n if sp.max_tokens is None else min(sp.max_tokens, self.max_model_len - n)
        self.scheduler.add_request(Request(
            request_id=req.request_id, prompt_token_ids=list(req.prompt_token_ids), sampling_params=sp,
            eos_token_ids=frozenset(req.eos_token_ids), max_tokens=max_tokens,
            arrival_time=req.arrival_time or time.monotonic(),
        ))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.abort_requests(request_ids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # ------------------------------------------------------------------ step
    def step(self) -> list[EngineCoreOutput]:
        """Schedule, run the model, update requests; return per-request new tokens and finishes."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        outputs: list[EngineCoreOutput] = []
        if not sched.is_empty:
            result = self.runner.execute(sched)
            for req in self.scheduler.update_from_output(sched, result.sampled):
                lp = result.logprobs.get(req.request_id)
                outputs.append(EngineCoreOutput(
                    request_id=req.request_id,
                    new_token_ids=[req.output_token_ids[-1]],
                    new_logprobs=[lp] if lp is not None else None,
                    finish_reason=req.status.finish_reason,
                    stop_reason=req.stop_reason,
                    num_prompt_tokens=req.num_prompt_tokens,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                ))
        self._update_stats(sched, time.perf_counter() - t0)
        return outputs

    def _update_stats(self, sched, seconds: float) -> None:
        s = self.scheduler
        st = self.last_stats
        st.step_prefill_tokens = sched.num_prefill_tokens
        st.step_decode_tokens = sched.num_decode_tokens
        st.num_running = len(s.running)
        st.num_waiting = len(s.waiting)
        st.kv_blocks_total = self.num_blocks
        st.kv_blocks_used = s.kv.num_owned_blocks()
        st.kv_usage = st.kv_blocks_used / self.num_blocks
        st.step_seconds = seconds
        st.cumulative = self.stats()

    def stats(self) -> dict:
        """Cumulative counters: steps, prefill/decode tokens, cached prompt tokens, prefix-cache
        queries and hits (tokens), preemptions; and current running/waiting/KV usage."""
        s = self.scheduler
        d = dict(vars(s.stats))
        d.update(num_running=len(s.running), num_waiting=len(s.waiting),
                 kv_blocks_used=s.kv.num_owned_blocks(), kv_blocks_total=self.num_blocks)
        return d

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.kv.reset_prefix_cache()
