"""The multiprocess executor: one worker process per tensor-parallel rank (vLLM v1's ``MultiprocExecutor``).

Layout (docs/parallelism.md)::

    engine core ──pipe──> rank 0 ... rank L-1     (the ranks this node's executor spawns)
                           rank 0 ──gloo broadcast──> ranks L .. N-1   (other nodes, or torchrun's processes)
    every rank <──torch.distributed group (gloo / NCCL)──> all-reduce, all-gather inside the forward

Each call (``initialize_kv_cache``, ``execute_model`` ...) is pickled once and written to every spawned
rank's pipe; rank 0 forwards it over a gloo group to the ranks that no pipe reaches. Every rank runs it
on its own :class:`~tinyvllm.worker.worker.Worker` (its share of the weights and of the KV heads); rank 0's
result comes back (all ranks hold the same gathered logits and sampler state, so they sample the same tokens).

Failure: the core waits on rank 0's pipe together with every spawned rank's process sentinel, and once a
second (:meth:`MultiprocExecutor.check_health`, also when idle) sends a no-op through all ranks; a rank that
died, on this node or another, becomes one ``RuntimeError`` line naming it, the core exits, and the API
process answers 503 and exits (as for any core death). Never a hang on a dead peer: gloo fails a collective
whose peer closed its socket, and ``TINYVLLM_DIST_TIMEOUT`` bounds the rest.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import signal
import socket
import sys
import time
import traceback
import weakref
from multiprocessing.connection import Connection, wait
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from tinyvllm import envs
from tinyvllm.config import EngineConfig
from tinyvllm.executor.abstract import Executor
from tinyvllm.outputs import ModelRunnerOutput
from tinyvllm.scheduler_output import SchedulerOutput
from tinyvllm.worker.worker import ModelInfo

logger = logging.getLogger("tinyvllm")

_EXECUTE = "execute_model"
_NOOP = "noop"
_SHUTDOWN = "shutdown"


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now (the single-node group's store port)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def rank_device(device: torch.device, rank: int, ranks_per_node: int) -> str:
    """The device of ``rank``: ``cpu``, or on CUDA the GPU of its index on its node (``cuda:<local rank>``)."""
    return "cpu" if device.type == "cpu" else f"cuda:{rank % ranks_per_node}"


class RankDiedError(RuntimeError):
    """A tensor-parallel rank exited or failed (the message names it, in one line)."""


def _set_pdeathsig() -> None:
    """Ask Linux to SIGTERM this process when its parent (the engine core) dies (no-op elsewhere)."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        except Exception:  # pragma: no cover - best effort
            pass


def fanout_ranks(world: int, pipe_ranks_node0: int) -> list[int]:
    """Ranks that rank 0 forwards each call to over gloo: rank 0 and every rank node 0's executor does not
    spawn (``[]``: every rank has a pipe)."""
    return [0, *range(pipe_ranks_node0, world)] if pipe_ranks_node0 < world else []


def run_worker(config: EngineConfig, device: str, model_dir: str, rank: int, conn: Connection | None,
               threads: int, master_addr: str, master_port: int, pipe_ranks_node0: int) -> None:
    """A rank's process (spawned by :class:`MultiprocExecutor`, or run in place on another node / under
    torchrun with ``conn=None``): join the group, load and shard the model, then run every call it gets
    (from ``conn``, or rank 0's gloo broadcast) until ``shutdown``. Exits 1 on any error (reported on
    ``conn`` when there is one)."""
    from tinyvllm.distributed.parallel_state import destroy_tp_group, init_tp_group
    from tinyvllm.worker.worker import Worker

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if conn is not None:
        _set_pdeathsig()  # the engine core died: so does this rank
    logging.basicConfig(level=logging.INFO,
                        format=f"%(asctime)s %(levelname)s %(name)s [TP rank {rank} pid %(process)d]: %(message)s")
    pc = config.parallel_config
    world = pc.tensor_parallel_size
    torch.set_num_threads(threads)
    torch.manual_seed(config.model_config.seed)  # the same default generator on every rank: the same draws
    tp = fan = worker = None
    try:
        tp = init_tp_group(rank, world, master_addr, master_port, torch.device(device))
        fan_ranks = fanout_ranks(world, pipe_ranks_node0)
        if fan_ranks:  # every rank takes part in creating a group
            import torch.distributed as dist

            fan = dist.new_group(ranks=fan_ranks, backend="gloo")
        if rank not in fan_ranks:
            fan = None
        worker = Worker(config, torch.device(device), model_dir, tp=tp)
        if conn is not None:
            conn.send(("ready", None))
        while True:
            if conn is not None:
                data = conn.recv_bytes()
                if rank == 0 and fan is not None:
                    _bcast(fan, data)
            else:
                data = _bcast(fan, None)
            method, args = pickle.loads(data)
            if method == _SHUTDOWN:
                break
            if method == _NOOP:
                result = None
            else:
                result = getattr(worker, method)(*args)
            # execute_model: rank 0 answers; other calls: every piped rank (a failure anywhere surfaces)
            if conn is not None and (rank == 0 or method != _EXECUTE):
                conn.send(("ok", result))
    except BaseException as e:  # noqa: BLE001 - report, then exit non-zero
        text = f"{type(e).__name__}: {e}".splitlines()[0] if str(e) else type(e).__name__
        logging.getLogger("tinyvllm").error("tensor-parallel rank %d failed: %s\n%s", rank, text,
                                            traceback.format_exc())
        if conn is not None:
            try:
                conn.send(("error", text))
            except OSError:
                pass
        os._exit(1)  # never wait in a collective or an atexit handler of a broken group
    finally:
        if worker is not None and worker.kv_connector is not None:
            worker.kv_connector.shutdown()
    if tp is not None:
        tp.reset_comm_stats()
    destroy_tp_group()


def _bcast(group: Any, obj: Any) -> Any:
    import torch.distributed as dist

    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class MultiprocExecutor(Executor):
    """Spawns this node's tensor-parallel ranks (``--tensor-parallel-size`` / ``--nnodes``), or only rank 0
    under torchrun (its other processes are the other ranks), and drives them.

    Raises:
        ValueError: a preloaded ``model`` (each rank loads its own share); a rank failed to start (its
            one-line error: a head count the ranks cannot split, a GGUF block split ...).
    """

    def __init__(self, config: EngineConfig, device: torch.device, model_dir: str | Path,
                 model: Any = None) -> None:
        super().__init__(config, device, model_dir, model)
        if model is not None:
            raise ValueError("tensor_parallel_size > 1 loads the model in every rank's process; "
                             "a preloaded model cannot be shared")
        pc = config.parallel_config
        self.world = pc.tensor_parallel_size
        spawn = pc.pipe_ranks()
        addr = pc.master_addr
        port = pc.master_port or free_port(addr)
        threads = envs.TINYVLLM_NUM_THREADS or max(1, (os.cpu_count() or 1) // len(spawn))
        ctx = multiprocessing.get_context("spawn")
        self.procs: dict[int, Any] = {}
        self.conns: dict[int, Connection] = {}
        self._closed = False
        for rank in spawn:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=run_worker, name=f"TPWorker-{rank}", daemon=True,
                            args=(config, rank_device(device, rank, pc.ranks_per_node), str(model_dir), rank, child,
                                  threads, addr, port, pc.pipe_ranks_node0))
            p.start()
            child.close()
            self.procs[rank], self.conns[rank] = p, parent
        logger.info("tensor parallelism: %d ranks (%s), %d spawned here (pids %s), %d thread(s) each, group at %s:%d",
                    self.world, "gloo" if device.type == "cpu" else "nccl", len(spawn),
                    ",".join(str(p.pid) for p in self.procs.values()), threads, addr, port)
        try:
            for rank in self.procs:
                self._reply(rank)
        except BaseException:
            self.shutdown()
            raise
        self._info: ModelInfo = self._call("model_info")
        from tinyvllm.model.registry import config_from_dir

        # what the core reads of "the model" (its config: EOS ids, vocabulary), without the weights
        self.model_stub = SimpleNamespace(config=config_from_dir(model_dir)[1],
                                          quantization=self._call("quantization"))
        weakref.finalize(self, MultiprocExecutor._stop, self.conns, self.procs)

    # ------------------------------------------------------------------ plumbing
    def _dead(self) -> str | None:
        for rank, p in self.procs.items():
            if not p.is_alive():
                text = None
                c = self.conns[rank]
                try:
                    while c.poll():
                        kind, payload = c.recv()
                        if kind == "error":
                            text = payload
                except (EOFError, OSError):
                    pass
                return (f"tensor-parallel rank {rank} (pid {p.pid}) exited with code {p.exitcode}"
                        + (f": {text}" if text else ""))
        return None

    def _reply(self, rank: int) -> Any:
        """Wait for ``rank``'s answer while watching every spawned rank's process.

        Raises:
            RankDiedError: a rank died or reported an error (one line).
        """
        conn = self.conns[rank]
        sentinels = [p.sentinel for p in self.procs.values()]
        while True:
            ready = wait([conn, *sentinels])
            if conn in ready:
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    kind, payload = "error", None
                if kind == "ok":
                    return payload
                if kind == "ready":
                    return None
                time.sleep(0.05)  # let the process finish exiting so that the message names its exit code
                raise RankDiedError(self._dead() or f"tensor-parallel rank {rank} failed: {payload}")
            why = self._dead()
            if why is not None:
                raise RankDiedError(why)

    def _call(self, method: str, *args: Any) -> Any:
        if self._closed:
            raise RankDiedError("the tensor-parallel workers are shut down")
        data = pickle.dumps((method, args), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self.conns.values():
                c.send_bytes(data)
        except (BrokenPipeError, OSError):
            raise RankDiedError(self._dead() or "a tensor-parallel rank closed its pipe") from None
        out = self._reply(0)
        if method != _EXECUTE:
            for rank in self.conns:
                if rank != 0:
                    self._reply(rank)
        return out

    # ------------------------------------------------------------------ Executor
    def model_info(self) -> ModelInfo:
        return self._info

    def initialize_kv_cache(self, num_blocks: int, max_model_len: int) -> None:
        self._call("initialize_kv_cache", num_blocks, max_model_len)

    def initialize_kv_offload(self, num_slots: int, path: str | None = None) -> list[tuple[int, int]]:
        if path is not None:
            raise ValueError("--kv-offload-path (the disk KV tier) is not supported with tensor parallelism yet; "
                             "the host-memory tier (--kv-offload-size alone) is")
        return self._call("initialize_kv_offload", num_slots, None)

    def initialize_kv_connector(self, engine_id: str) -> dict:
        raise ValueError("--kv-transfer-config (prefill/decode disaggregation) is not supported with "
                         "--tensor-parallel-size > 1 yet")

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self._call("execute_model", scheduler_output)

    def check_health(self) -> None:
        """A no-op through every rank (keeps idle ranks' collectives inside the timeout; a dead rank on any
        node shows here).

        Raises:
            RankDiedError: a rank is gone.
        """
        self._call(_NOOP)

    def comm_stats(self) -> tuple[float, int]:
        """Rank 0's ``(seconds, calls)`` in tensor collectives since the last call (then reset)."""
        return self._call("tp_comm_stats")

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._stop(self.conns, self.procs)

    @staticmethod
    def _stop(conns: dict[int, Connection], procs: dict[int, Any]) -> None:
        data = pickle.dumps((_SHUTDOWN, ()))
        for c in conns.values():
            try:
                c.send_bytes(data)
            except OSError:
                pass
        deadline = time.monotonic() + 5
        for p in procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.terminate()
                p.join(1)


def run_headless(config: EngineConfig, model_dir: str, ranks: list[int], pipe_ranks_node0: int) -> int:
    """Run ``ranks`` of the group on this node (``--node-rank`` > 0, or a torchrun process other than rank 0):
    no API server, no engine core; rank 0 on node 0 sends every call. Returns the exit code (1 if a rank
    failed)."""
    pc = config.parallel_config
    from tinyvllm.config import resolve_device

    device = resolve_device(config.model_config.device)
    threads = envs.TINYVLLM_NUM_THREADS or max(1, (os.cpu_count() or 1) // len(ranks))
    if len(ranks) == 1:  # in this process (torchrun's one process per rank)
        try:
            run_worker(config, rank_device(device, ranks[0], pc.ranks_per_node), model_dir, ranks[0], None,
                       threads, pc.master_addr, pc.master_port, pipe_ranks_node0)
        except SystemExit as e:
            return int(e.code or 0)
        return 0
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=run_worker, name=f"TPWorker-{r}",
                         args=(config, rank_device(device, r, pc.ranks_per_node), model_dir, r, None, threads,
                               pc.master_addr, pc.master_port, pipe_ranks_node0)) for r in ranks]
    for p in procs:
        p.start()
    code = 0
    try:
        while procs:
            wait([p.sentinel for p in procs])
            for p in list(procs):
                if not p.is_alive():
                    procs.remove(p)
                    code = code or (p.exitcode or 0)
            if code:
                break
    finally:
        for p in procs:
            p.terminate()
    return code
