"""CUDA graphs of the decode step (what vLLM does unless ``--enforce-eager``).

A decode step launches hundreds of small kernels (30 layers x norms, GEMMs,
RoPE, KV store, attention); at small batch sizes the CPU cannot launch them as
fast as the GPU runs them.  A CUDA graph records the whole forward once and
replays it with one launch.  A graph replays fixed shapes and fixed addresses,
so:

* the forward reads its inputs from **static buffers** (token ids, positions,
  slot mapping, block tables padded to ``ceil(max_model_len / block_size)``
  columns, int32 context lengths), and each step copies its inputs into them;
* one graph is captured per **batch size** in :data:`CAPTURE_SIZES` (capped by
  ``max_num_seqs``); a batch of ``n`` sequences is padded to the smallest
  captured size ``>= n``.  A padding row has slot ``-1`` (``reshape_and_cache``
  stores nothing) and context length 0 (attention reads nothing, outputs 0),
  so padding never touches real KV; its hidden state is computed and dropped;
* only **decode-only** steps (every sequence has one new token) are replayed;
  prefill and mixed steps, and batches larger than the largest captured size,
  run eagerly.

Stale entries of the static block table (columns past a row's own table, rows
past ``n``) are never read: attention reads only the first
``ceil(seq_len / block_size)`` entries of a row, and padding rows have
``seq_len == 0``.

Capture needs a forward that never synchronises with the host (no ``.item()``,
no data-dependent shapes); :meth:`DecodeGraphRunner.capture` checks that first
with ``torch.cuda.set_sync_debug_mode("error")`` and, if the forward does
synchronise, logs why and leaves the runner eager instead of failing the engine.

With ``use_graphs=False`` the runner runs the same padded static-buffer forward
eagerly; tests use that on the CPU (Triton interpreter) to check the padding.
"""

from __future__ import annotations

import bisect
import logging
import time

import torch

from tinyvllm.attention.triton import TritonAttentionMetadata

logger = logging.getLogger("tinyvllm")

CAPTURE_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def capture_sizes(max_num_seqs: int, sizes: tuple[int, ...] | None = None) -> list[int]:
    """Batch sizes to capture: :data:`CAPTURE_SIZES` capped by ``max_num_seqs`` (the cap itself included)."""
    sizes = CAPTURE_SIZES if sizes is None else sizes
    return sorted({min(b, max_num_seqs) for b in sizes if b >= 1})


class DecodeGraphRunner:
    """Decode forward over static input buffers, replayed from one CUDA graph per padded batch size."""

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int, max_num_seqs: int,
                 max_model_len: int, device: torch.device, use_graphs: bool = True,
                 sizes: tuple[int, ...] | None = None) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = torch.device(device)
        self.use_graphs = use_graphs
        self.sizes = capture_sizes(max_num_seqs, sizes)
        self.max_batch = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        b, dev = self.max_batch, self.device
        self.input_ids = torch.zeros(b, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(b, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((b,), -1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(b, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.arange(b + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(b, self.max_blocks, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    # ------------------------------------------------------------------ forward over the static buffers
    def _metadata(self, bs: int) -> TritonAttentionMetadata:
        return TritonAttentionMetadata(self.slot_mapping[:bs], self.block_tables[:bs], self.seq_lens[:bs],
                                       self.query_start_loc[: bs + 1], decode_only=True)

    def _forward(self, bs: int) -> torch.Tensor:
        return self.model(self.input_ids[:bs], self.positions[:bs], self.kv_caches, self._metadata(bs))

    def _reset_padding(self) -> None:
        """Every row a padding row (stores nothing, reads nothing)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(-1)
        self.seq_lens.zero_()

    # ------------------------------------------------------------------ capture
    def capture(self) -> bool:
        """Warm up and capture one graph per size (largest first, one shared memory pool).

        Returns:
            True if graphs were captured; False (after logging why) if this forward cannot be
            captured, in which case the runner stays eager and the caller should not use it.
        """
        if not self.use_graphs:
            return False
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        t0 = time.monotonic()
        self._reset_padding()
        with torch.inference_mode():
            # Warm up every size eagerly: compiles the Triton kernels for each launch shape, builds the
            # RoPE tables and cuBLAS workspaces, so that nothing is compiled or allocated lazily mid-capture.
            for bs in reversed(self.sizes):
                self._forward(bs)
            torch.cuda.synchronize(self.device)
            previous = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("error")
            try:
                self._forward(self.max_batch)
            except RuntimeError as e:
                logger.warning("CUDA graphs disabled: the decode forward synchronises with the host (%s); "
                               "running decode steps eagerly", str(e).splitlines()[0])
                return False
            finally:
                torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize(self.device)
            pool = torch.cuda.graph_pool_handle()
            for bs in reversed(self.sizes):
                graph = torch.cuda.CUDAGraph()
                try:
                    with torch.cuda.graph(graph, pool=pool):
                        out = self._forward(bs)
                except RuntimeError as e:
                    raise RuntimeError(f"CUDA graph capture of the decode step failed at batch size {bs}: {e} "
                                       "(start the engine with --enforce-eager to run without CUDA graphs)") from e
                self.graphs[bs] = graph
                self.outputs[bs] = out
            torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs of the decode step for batch sizes %s in %.1fs",
                    self.sizes, time.monotonic() - t0)
        return True

    # ------------------------------------------------------------------ replay
    def padded_size(self, num_seqs: int) -> int | None:
        """Smallest captured size >= ``num_seqs``, or None if the batch is too large."""
        i = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[i] if i < len(self.sizes) else None

    def can_run(self, num_seqs: int, max_table_len: int) -> bool:
        return 1 <= num_seqs <= self.max_batch and max_table_len <= self.max_blocks

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor:
        """Forward of a decode-only batch (one token per sequence, ``seq_lens[i] == positions[i] + 1``).

        Returns:
            [num_seqs, hidden] final hidden states. With graphs this is a view of the graph's output
            buffer, valid until the next :meth:`run`.
        """
        n = len(input_ids)
        bs = self.padded_size(n)
        if bs is None or not self.can_run(n, max(len(t) for t in block_tables)):
            raise ValueError(f"batch of {n} sequences cannot run on the decode graphs (max {self.max_batch})")
        bsz = self.block_size
        pad = bs - n
        slots = [t[p // bsz] * bsz + p % bsz for t, p in zip(block_tables, positions)]
        host = torch.tensor([input_ids + [0] * pad, positions + [0] * pad, slots + [-1] * pad,
                             seq_lens + [0] * pad], dtype=torch.int64)
        width = max(len(t) for t in block_tables)
        table = torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int64)
        self.input_ids[:bs].copy_(host[0])
        self.positions[:bs].copy_(host[1])
        self.slot_mapping[:bs].copy_(host[2])
        self.seq_lens[:bs].copy_(host[3])
        self.block_tables[:n, :width].copy_(table)
        if bs in self.graphs:
            self.graphs[bs].replay()
            return self.outputs[bs][:n]
        return self._forward(bs)[:n]
