"""Tensor-parallel state: this rank's place in the ``torch.distributed`` group and the collectives the
parallel layers call (the role of vLLM's ``distributed/parallel_state.py`` ``GroupCoordinator``, reduced
to what tensor parallelism on one group needs).

One group spans every rank of every node (``world_size = tensor_parallel_size``). On the CPU it is a
gloo group; on CUDA the tensors go through NCCL and a second, gloo group carries Python objects (the
schedule each step, :func:`broadcast_object`), as vLLM's ``cpu_group`` does.

Exactness: an all-reduce sums each rank's partial result; with two ranks every rank gets ``a + b``
(IEEE addition commutes), and with more, gloo's ring reduces each chunk once and copies it to all, so
all ranks hold the same bits. The sum's order differs from one rank's single GEMM, so TP=N is not
bit-equal to TP=1 (docs/parallelism.md has the measured gap). The partial sums are all-reduced in
float32 whatever the model dtype (:meth:`TPGroup.all_reduce_float32`): a bf16 all-reduce would round
every partial first.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    """This process's rank in the tensor-parallel group.

    Attributes:
        rank: 0 .. world_size - 1 (rank 0 returns the step's output to the engine core).
        world_size: the tensor-parallel size.
        group: the process group the tensors' collectives run on (gloo on CPU, NCCL on CUDA).
        cpu_group: a gloo group for Python objects (the same group on the CPU).
        comm_seconds: wall time spent in the tensor collectives since the last reset (the all-reduce
            share of a step, docs/parallelism.md).
        comm_calls: how many tensor collectives ran since the last reset.
    """

    rank: int
    world_size: int
    group: Any = None
    cpu_group: Any = None
    comm_seconds: float = 0.0
    comm_calls: int = 0
    _gather_bufs: dict = field(default_factory=dict)

    def all_reduce_float32(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (float32, any shape) over the ranks, in place; returns ``x``. Every rank gets the same bits."""
        t0 = time.perf_counter()
        dist.all_reduce(x, group=self.group)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return x

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks in its own dtype (for sums with one non-zero term per element, exact in
        any dtype: the vocab-parallel embedding), in place; returns ``x``."""
        return self.all_reduce_float32(x)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``x`` [N, n] (the same shape on every rank) along the last dim:
        [N, world_size * n], rank 0's columns first. A copy: exact."""
        t0 = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        out = torch.cat(parts, dim=-1)
        self.comm_seconds += time.perf_counter() - t0
        self.comm_calls += 1
        return out

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (pickled, over the gloo group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def reset_comm_stats(self) -> tuple[float, int]:
        """``(comm_seconds, comm_calls)`` so far, then zero them."""
        out = (self.comm_seconds, self.comm_calls)
        self.comm_seconds, self.comm_calls = 0.0, 0
        return out


def init_tp_group(rank: int, world_size: int, master_addr: str, master_port: int, device: torch.device,
                  timeout_s: float | None = None) -> TPGroup:
    """Join the ``world_size``-rank group whose TCP store rank 0 hosts at ``master_addr:master_port``
    (``torch.distributed.init_process_group``, ``tcp://`` init: the way torchrun's rendezvous starts
    PyTorch jobs). Blocks until every rank joined, or ``timeout_s`` (``TINYVLLM_DIST_TIMEOUT``).

    Raises:
        RuntimeError / DistStoreError: the store cannot be reached or bound (port in use), or a timeout.
    """
    from tinyvllm import envs

    timeout = datetime.timedelta(seconds=timeout_s if timeout_s is not None else envs.TINYVLLM_DIST_TIMEOUT)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                            world_size=world_size, timeout=timeout)
    group = dist.group.WORLD
    cpu_group = group if backend == "gloo" else dist.new_group(backend="gloo", timeout=timeout)
    return TPGroup(rank, world_size, group, cpu_group)


def destroy_tp_group() -> None:
    """Leave the group (no-op if this process is in none)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def split_sizes(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` contiguous shares differing by at most one, the larger first
    (9 heads over 2 ranks: [5, 4])."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]
