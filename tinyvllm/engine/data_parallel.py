"""Data parallelism behind one API server (``tinyvllm serve --data-parallel-size N`` / ``-dp N``, vLLM's flag).

The API process starts N engine-core processes, each a full replica (its own model copy, KV cache and
prefix cache), and sends every request to one of them. This module holds what is specific to that:

* :func:`check_data_parallel`: the one-line refusals at start (P/D, TP, more replicas than cores or GPUs);
* :func:`replica_config`: replica ``i``'s config (its own disk-tier subdirectory, KV-events port, GPU);
* :func:`sum_stats`: one :class:`SchedulerStats` over the replicas (``/debug/stats``, the dashboard);
* :class:`DPRouter`: which replica a request goes to.

Routing (``--dp-routing prefix``, the default) follows **NVIDIA Dynamo's KV router in its approximate mode**
(no KV events: the router predicts each worker's cache from its own routing decisions), with the prefix
lookup of **SGLang's cache-aware router** (an approximate tree of what was sent to each worker, kept in LRU
order and bounded by the worker's cache size) done on **vLLM's chained block hashes**
(:func:`tinyvllm.core.kv_cache_manager.extend_block_hashes`, so a "match" is a whole KV block the engine can
reuse, ``cache_salt`` included). For each replica ``i`` the cost of sending it the request is Dynamo's::

    cost_i = w * (prefill blocks this request would compute on i) + blocks held by the requests running on i

where the prefill blocks are the prompt's blocks minus the leading run replica ``i`` is predicted to hold, and
``w`` is Dynamo's ``kv_overlap_score_weight`` (``TINYVLLM_DP_PREFILL_WEIGHT``: 16 here, 1 in Dynamo). Dynamo
counts a running request's blocks as its decode cost, which on a GPU is memory traffic; on a CPU a prefill
token costs far more than one more sequence in the decode batch, and with a small ``w`` an agent's turn left
the replica holding its history whenever another session ran there (measured, docs/parallelism.md). The
replica of least cost wins; ties go to the fewest outstanding requests, then round-robin, so an idle server
spreads new sessions. The load part alone is vLLM's DP load balancing (the engine with the least work); the
prefix part keeps an agent session's turns on the replica that holds its history unless that replica is so
much busier that recomputing elsewhere is cheaper.

A request's blocks enter its replica's prediction once its prefill is done (its first output), not when it is
routed (SGLang inserts at routing time): requests that arrive together with the same new prefix would all
follow the first to one replica before any of it is cached (vllm-router's ``cache_aware`` put a whole agent
run on one replica that way, docs/benchmarks.md). The prediction can still be wrong (a replica evicted blocks):
a misroute only costs recomputation, never a wrong token. ``round-robin`` and ``least-loaded`` (fewest
outstanding requests) are there to compare against.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Sequence

import msgspec

from tinyvllm import envs
from tinyvllm.config import EngineConfig
from tinyvllm.metrics.stats import SchedulerStats


def check_data_parallel(config: EngineConfig) -> None:
    """Refuse what data parallelism does not support, in one line.

    Raises:
        ValueError: ``--kv-transfer-config`` (P/D), ``--tensor-parallel-size`` > 1, more replicas than CPU
            cores (CPU: each replica needs one) or than visible GPUs (CUDA: one GPU per replica), or an explicit
            ``--device cuda:N``.
    """
    pc = config.parallel_config
    dp = pc.data_parallel_size
    if dp == 1:
        return
    if config.cache_config.kv_transfer_config is not None:
        raise ValueError("--kv-transfer-config (prefill/decode disaggregation) is not supported with "
                         "--data-parallel-size > 1; run one prefill and one decode server per replica behind "
                         "vllm-router (docs/disaggregation.md)")
    if pc.tensor_parallel_size > 1 or pc.nnodes > 1:
        raise ValueError("--data-parallel-size > 1 with --tensor-parallel-size > 1 is not supported yet; "
                         "run one tensor-parallel server per replica behind vllm-router (docs/parallelism.md)")
    from tinyvllm.config import resolve_device

    device = config.model_config.device
    dev = resolve_device(device)
    if dev.type == "cuda":
        import torch

        if str(device) not in ("auto", "cuda"):
            raise ValueError(f"--device {device} with --data-parallel-size {dp}: replica i runs on cuda:i; "
                             "use --device cuda (or auto) and CUDA_VISIBLE_DEVICES to choose the GPUs")
        if dp > torch.cuda.device_count():
            raise ValueError(f"data_parallel_size {dp} needs {dp} GPUs (one per replica), "
                             f"{torch.cuda.device_count()} visible")
    elif dp > (os.cpu_count() or 1):
        raise ValueError(f"data_parallel_size {dp} puts {dp} engine cores on this machine's {os.cpu_count()} "
                         "CPU cores (one core per replica at least)")


def _offset_endpoint(endpoint: str, rank: int) -> str:
    """vLLM's ``offset_endpoint_port``: a ``tcp://`` endpoint's port + ``rank``; ``ipc://`` / ``inproc://`` get
    ``_dp{rank}`` appended."""
    if rank == 0:
        return endpoint
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_dp{rank}"
    m = re.fullmatch(r"(.*):(\d+)", endpoint)
    if m is None:
        raise ValueError(f"kv_events_config.endpoint {endpoint!r} has no port to offset per replica")
    return f"{m.group(1)}:{int(m.group(2)) + rank}"


def replica_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Replica ``rank``'s engine config: ``data_parallel_rank`` set; the disk KV tier in its own subdirectory
    ``dp<rank>`` of ``--kv-offload-path`` (two replicas never share a file); the KV-events endpoint's port
    offset by ``rank`` (vLLM's rule); on CUDA, GPU ``cuda:<rank>``. Unchanged when there is one replica."""
    pc = config.parallel_config
    if pc.data_parallel_size == 1:
        return config
    cc, mc = config.cache_config, config.model_config
    if cc.kv_offload_path is not None:
        cc = dataclasses.replace(cc, kv_offload_path=os.path.join(cc.kv_offload_path, f"dp{rank}"))
    ev = cc.kv_events_config
    if ev is not None and ev.enabled and ev.publisher == "zmq":
        cc = dataclasses.replace(cc, kv_events_config=dataclasses.replace(
            ev, endpoint=_offset_endpoint(ev.endpoint, rank)))
    from tinyvllm.config import resolve_device

    if resolve_device(mc.device).type == "cuda":
        mc = dataclasses.replace(mc, device=f"cuda:{rank}")
    return dataclasses.replace(config, cache_config=cc, model_config=mc,
                               parallel_config=dataclasses.replace(pc, data_parallel_rank=rank))


def replica_threads(config: EngineConfig) -> int:
    """Torch threads of each replica: the machine's cores divided by the replicas (0: torch's default, one
    replica). ``TINYVLLM_NUM_THREADS`` still overrides it (the worker sets it last)."""
    dp = config.parallel_config.data_parallel_size
    return 0 if dp == 1 else max(1, (os.cpu_count() or 1) // dp)


_KEEP_MAX = ("kv_offload_block_bytes",)  # the same on every replica: not a sum


def sum_stats(stats: Sequence[SchedulerStats]) -> SchedulerStats:
    """One :class:`SchedulerStats` over the replicas: gauges and counters summed (per-position lists
    element-wise, miss reasons per key), the block size of the offload tier as is."""
    if len(stats) == 1:
        return stats[0]
    out: dict = {}
    for s in stats:
        for k, v in msgspec.structs.asdict(s).items():
            if k in _KEEP_MAX:
                out[k] = max(out.get(k, 0), v)
            elif isinstance(v, dict):
                d = out.setdefault(k, {})
                for kk, vv in v.items():
                    d[kk] = d.get(kk, 0) + vv
            elif isinstance(v, list):
                acc = out.setdefault(k, [])
                acc.extend([0] * (len(v) - len(acc)))
                for i, x in enumerate(v):
                    acc[i] += x
            else:
                out[k] = out.get(k, 0) + v
    return SchedulerStats(**out)


@dataclass
class _Routed:
    replica: int
    active_blocks: int  # blocks it holds while it runs (its prompt's)
    hashes: list[int] | None  # its prompt's block hashes until its prefill is done (then in the prediction)


@dataclass
class _ReplicaLoad:
    cached: "OrderedDict[int, None]" = field(default_factory=OrderedDict)  # predicted prefix cache, LRU order
    capacity: int = 0
    active_blocks: int = 0
    outstanding: int = 0
    routed: int = 0  # requests sent here since start
    predicted_hit_blocks: int = 0  # blocks the router expected this replica to hold, summed over its requests


class DPRouter:
    """Picks the replica of each request (see the module docstring for the policy and its sources).

    Args:
        num_replicas: the engine cores.
        block_size: tokens per KV block (the engines').
        capacities: each replica's KV blocks: the bound of its predicted cache (SGLang's tree size limit).
        policy: ``prefix``, ``round-robin`` or ``least-loaded``.
        enable_prefix_caching: with the engines' prefix cache off, ``prefix`` is ``least-loaded`` by blocks.
    """

    def __init__(self, num_replicas: int, block_size: int, capacities: Sequence[int], policy: str = "prefix",
                 enable_prefix_caching: bool = True) -> None:
        self.n = num_replicas
        self.block_size = block_size
        self.policy = policy
        self.caching = enable_prefix_caching
        self.replicas = [_ReplicaLoad(capacity=max(1, c)) for c in capacities]
        self.requests: dict[str, _Routed] = {}
        self.prefill_weight = envs.TINYVLLM_DP_PREFILL_WEIGHT
        self._next = 0  # round-robin cursor (also the tie-break's start)

    # ------------------------------------------------------------------ routing
    def block_hashes(self, prompt_token_ids: Sequence[int], cache_salt: str | None = None) -> list[int]:
        """The prompt's full blocks' chained hashes, as the engine computes them (``cache_salt`` in the first)."""
        from tinyvllm.core.kv_cache_manager import extend_block_hashes

        return extend_block_hashes([], prompt_token_ids, self.block_size, len(prompt_token_ids) // self.block_size,
                                   cache_salt)

    def _match(self, replica: _ReplicaLoad, hashes: list[int]) -> int:
        # The engine reuses at most (len - 1) // bs blocks (one token is always computed); hashes has len // bs.
        n = 0
        for h in hashes:
            if h not in replica.cached:
                break
            n += 1
        return n

    def route(self, request_id: str, prompt_token_ids: Sequence[int], cache_salt: str | None = None,
              pinned: int | None = None) -> int:
        """The replica for a request, recorded until :meth:`finish`; ``pinned`` forces one (a caller's
        ``data_parallel_rank``)."""
        num_blocks = -(-len(prompt_token_ids) // self.block_size)
        max_hit = max(0, (len(prompt_token_ids) - 1) // self.block_size)  # one token is always computed
        hashes = self.block_hashes(prompt_token_ids, cache_salt) if self.caching else []
        matches = [min(self._match(r, hashes), max_hit) for r in self.replicas] if hashes else [0] * self.n
        order = [(self._next + k) % self.n for k in range(self.n)]
        if pinned is not None:
            best = pinned
        elif self.policy == "round-robin":
            best = self._next
        elif self.policy == "least-loaded":
            best = min(order, key=lambda i: self.replicas[i].outstanding)
        else:
            def cost(i: int) -> tuple[float, int]:
                r = self.replicas[i]
                return self.prefill_weight * (num_blocks - matches[i]) + r.active_blocks, r.outstanding

            best = min(order, key=cost)  # min keeps the first of equals: the round-robin order breaks ties
        self._next = (self._next + 1) % self.n
        r = self.replicas[best]
        self.requests[request_id] = _Routed(best, num_blocks, hashes or None)
        r.active_blocks += num_blocks
        r.outstanding += 1
        r.routed += 1
        r.predicted_hit_blocks += matches[best]
        return best

    def replica_of(self, request_id: str) -> int | None:
        routed = self.requests.get(request_id)
        return None if routed is None else routed.replica

    def prefill_done(self, request_id: str) -> None:
        """The request's first output arrived: its prompt's blocks are in its replica's cache now (predicted,
        most recently used first)."""
        routed = self.requests.get(request_id)
        if routed is None or routed.hashes is None:
            return
        r = self.replicas[routed.replica]
        for h in routed.hashes:
            r.cached[h] = None
            r.cached.move_to_end(h)
        while len(r.cached) > r.capacity:
            r.cached.popitem(last=False)
        routed.hashes = None

    def finish(self, request_id: str) -> int | None:
        """The request finished or was aborted: drop its load; returns its replica (None if unknown). Call
        :meth:`prefill_done` first if it produced output (an abort before any output predicts nothing)."""
        routed = self.requests.pop(request_id, None)
        if routed is None:
            return None
        r = self.replicas[routed.replica]
        r.active_blocks -= routed.active_blocks
        r.outstanding -= 1
        return routed.replica

    def reset(self) -> None:
        """The replicas' prefix caches were reset: forget the predictions."""
        for r in self.replicas:
            r.cached.clear()

    def state(self, i: int) -> dict[str, int]:
        r = self.replicas[i]
        return {"routed_requests": r.routed, "outstanding_requests": r.outstanding,
                "predicted_hit_blocks": r.predicted_hit_blocks, "predicted_cached_blocks": len(r.cached)}
