"""KV offload tier, worker half: the tier's bytes, and the copies between it and the KV pool.

The scheduler half (:mod:`tinyvllm.core.kv_offload`) decides which block hash
lives in which *slot*; this module holds the slots and runs the copies the
schedule lists (``SchedulerOutput.kv_offload_stores`` / ``kv_offload_loads``).
A slot is one KV block of every layer, laid out contiguously:
``data[slot]`` is ``[num_layers, 2, block_size, num_kv_heads, head_dim]`` in the
KV dtype. Copies are plain ``index_select``/``index_copy`` of the same dtype:
the bytes round-trip exactly (never re-quantized), so a block loaded from the
tier is bit-identical to the block that was stored.

Two kinds of slot storage:

* :class:`HostKVTier` -- a tensor in host RAM (pinned on CUDA); ``--kv-offload-size``.
* :class:`DiskKVTier` -- a file in ``--kv-offload-path`` mapped with
  ``torch.from_file(shared=True)``, so the page cache is the host copy and the
  blocks survive a restart. File layout (little endian)::

      [0, 4096)            header: magic, version, JSON {fingerprint, layout}
      [4096, data_off)     one record per slot: 5 x uint64
                           (hash low 64 bits, hash high 64 bits, xxh3_64 of the slot's bytes,
                            store sequence number, valid flag)
      [data_off, end)      the slots (data_off a multiple of 4096)

  A store first clears the slot's valid flag, then writes the data, then the
  hash, checksum and sequence number, and the valid flag last; a process killed
  mid-write therefore leaves the slot invalid (or valid with a checksum that the
  next start verifies). On open, a header whose fingerprint (model files'
  names, sizes and mtimes, dtype, block size, KV shape, hash scheme) or layout
  differs from this engine's is ignored with one warning and the file is
  re-initialized; a valid slot whose checksum does not match is dropped (one
  warning with the count). No ``msync``: the data survives the process, not a
  power loss before the kernel writes it back.

Read for the design, not copied: vLLM ``v1/kv_offload`` (CPU offloading worker),
llama.cpp server slot save/restore (a file per slot with a header).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import xxhash

logger = logging.getLogger("tinyvllm")

__all__ = ["HostKVTier", "DiskKVTier", "make_fingerprint", "KVTierError"]

_MAGIC = b"TVKVTIER"
_VERSION = 1
_HEADER_BYTES = 4096
_REC_WORDS = 5  # hash lo, hash hi, checksum, seq, valid
_VALID = 0x56414C49444B5631  # "VALIDKV1"
FILE_NAME = "kv_offload.bin"


class KVTierError(RuntimeError):
    """The offload tier cannot be created (unwritable path, not enough disk space)."""


def make_fingerprint(model_dir: str | Path, dtype: torch.dtype, block_size: int, num_layers: int,
                     num_kv_heads: int, head_dim: int, extra: dict | None = None) -> dict:
    """What must match for a disk tier's blocks to be reused: the model's files (name, size, mtime_ns of
    every regular file in ``model_dir``), the KV dtype, block size and shape, and the block-hash scheme."""
    files = []
    d = Path(model_dir)
    if d.is_dir():
        for p in sorted(d.iterdir()):
            if p.is_file():
                st = p.stat()
                files.append([p.name, st.st_size, st.st_mtime_ns])
    return {"model_dir": str(d.resolve()), "files": files, "dtype": str(dtype), "block_size": block_size,
            "num_layers": num_layers, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "block_hash": "xxh3_128 chained v1", **(extra or {})}


class HostKVTier:
    """``num_slots`` KV blocks in host memory.

    Args:
        num_slots: slots (>= 1).
        slot_shape: ``(num_layers, 2, block_size, num_kv_heads, head_dim)``.
        dtype: the KV cache dtype.
        pin_memory: page-lock the tensor (CUDA: faster, asynchronous host<->device copies).
    """

    def __init__(self, num_slots: int, slot_shape: Sequence[int], dtype: torch.dtype,
                 pin_memory: bool = False) -> None:
        self.num_slots = num_slots
        self.slot_shape = tuple(slot_shape)
        self.dtype = dtype
        self.data = torch.empty((num_slots, *self.slot_shape), dtype=dtype, pin_memory=pin_memory)
        self.bytes_stored = 0
        self.bytes_loaded = 0
        self.load_seconds = 0.0

    @property
    def slot_bytes(self) -> int:
        return self.data[0].numel() * self.data.element_size()

    def entries(self) -> list[tuple[int, int]]:
        """``(slot, block hash)`` of the blocks found when the tier was opened (none for host RAM)."""
        return []

    # -- copies --------------------------------------------------------------
    def store(self, kv_caches: list[torch.Tensor], ops: Sequence[Sequence]) -> None:
        """Copy pool blocks into slots: ``ops`` is ``[(block_id, slot, block hash hex)]``;
        ``kv_caches[l]`` is ``[2, num_blocks, block_size, Hk, D]``."""
        if not ops:
            return
        blocks = torch.tensor([op[0] for op in ops], dtype=torch.int64, device=kv_caches[0].device)
        slots = torch.tensor([op[1] for op in ops], dtype=torch.int64)
        self._before_write([op[1] for op in ops])
        for layer, kv in enumerate(kv_caches):
            # [2, n, bs, Hk, D] -> [n, 2, bs, Hk, D]; same dtype: a byte copy
            self.data[slots, layer] = kv.index_select(1, blocks).transpose(0, 1).to("cpu")
        self._after_write([(op[1], int(op[2], 16)) for op in ops])
        self.bytes_stored += len(ops) * self.slot_bytes

    def load(self, kv_caches: list[torch.Tensor], ops: list[tuple[int, int]]) -> None:
        """Copy slots back into pool blocks: ``ops`` is ``[(slot, block_id)]``."""
        if not ops:
            return
        import time

        t0 = time.perf_counter()
        dev = kv_caches[0].device
        slots = torch.tensor([s for s, _ in ops], dtype=torch.int64)
        blocks = torch.tensor([b for _, b in ops], dtype=torch.int64, device=dev)
        for layer, kv in enumerate(kv_caches):
            kv.index_copy_(1, blocks, self.data[slots, layer].transpose(0, 1).to(dev, non_blocking=True))
        if dev.type == "cuda":
            torch.cuda.current_stream(dev).synchronize()
        self.load_seconds += time.perf_counter() - t0
        self.bytes_loaded += len(ops) * self.slot_bytes

    # hooks for the disk tier's per-slot records
    def _before_write(self, slots: list[int]) -> None:
        pass

    def _after_write(self, slot_hashes: list[tuple[int, int]]) -> None:
        pass

    def close(self) -> None:
        pass


class DiskKVTier(HostKVTier):
    """``num_slots`` KV blocks in ``directory/kv_offload.bin``, kept across restarts.

    Args:
        directory: created if missing.
        num_slots / slot_shape / dtype: as :class:`HostKVTier`.
        fingerprint: :func:`make_fingerprint` of this engine; a file with another is re-initialized.

    Raises:
        KVTierError: the directory or file cannot be created or written, or the disk has not
            enough free space for the whole file (checked with ``posix_fallocate`` at start).
    """

    def __init__(self, directory: str | Path, num_slots: int, slot_shape: Sequence[int], dtype: torch.dtype,
                 fingerprint: dict) -> None:
        self.num_slots = num_slots
        self.slot_shape = tuple(slot_shape)
        self.dtype = dtype
        self.bytes_stored = self.bytes_loaded = 0
        self.load_seconds = 0.0
        self.path = Path(directory) / FILE_NAME
        slot_bytes = int(np.prod(self.slot_shape)) * torch.empty((), dtype=dtype).element_size()
        rec_bytes = num_slots * _REC_WORDS * 8
        data_off = -(-(_HEADER_BYTES + rec_bytes) // 4096) * 4096
        total = data_off + num_slots * slot_bytes
        layout = {"num_slots": num_slots, "slot_bytes": slot_bytes, "data_off": data_off, "total": total}
        header = {"fingerprint": fingerprint, "layout": layout}
        try:
            Path(directory).mkdir(parents=True, exist_ok=True)
            existing = self.path.exists()
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                old = os.pread(fd, _HEADER_BYTES, 0) if existing else b""
                reuse = self._header_matches(old, header)
                if existing and not reuse:
                    logger.warning("KV offload file %s was written by another model/config (or is damaged); "
                                   "ignoring its blocks and re-initializing it", self.path)
                if not reuse:
                    os.ftruncate(fd, 0)
                have = os.fstat(fd).st_blocks * 512  # already allocated to the file
                free = shutil.disk_usage(directory).free
                if total > have + free:  # checked first: a failing fallocate may leave blocks allocated
                    raise KVTierError(f"--kv-offload-path {directory}: the KV offload file needs "
                                      f"{total / 2**30:.2f} GiB but only {(have + free) / 2**30:.2f} GiB are "
                                      f"free; lower --kv-offload-size or free disk space")
                try:
                    os.posix_fallocate(fd, 0, total)
                except OSError as e:
                    os.ftruncate(fd, 0)  # give back whatever the failed reservation allocated
                    raise KVTierError(f"--kv-offload-path {directory}: cannot reserve {total / 2**30:.2f} GiB "
                                      f"for the KV offload file ({e.strerror}); lower --kv-offload-size or free "
                                      f"disk space") from e
                if not reuse:
                    blob = json.dumps(header).encode()
                    if len(blob) > _HEADER_BYTES - 16:
                        header["fingerprint"] = {"digest": xxhash.xxh3_128_hexdigest(blob)}
                        blob = json.dumps(header).encode()
                    hdr = _MAGIC + _VERSION.to_bytes(4, "little") + len(blob).to_bytes(4, "little") + blob
                    os.pwrite(fd, hdr.ljust(_HEADER_BYTES, b"\0"), 0)
            finally:
                os.close(fd)
            self._file = torch.from_file(str(self.path), shared=True, size=total, dtype=torch.uint8)
        except KVTierError:
            raise
        except OSError as e:
            raise KVTierError(f"--kv-offload-path {directory}: {e.strerror or e}") from e
        self._records = self._file[_HEADER_BYTES:_HEADER_BYTES + rec_bytes].numpy().view(np.uint64).reshape(
            num_slots, _REC_WORDS)
        self.data = self._file[data_off:total].view(dtype).view(num_slots, *self.slot_shape)
        self._seq = 0
        self._entries = self._scan() if reuse else []

    @staticmethod
    def _header_matches(raw: bytes, header: dict) -> bool:
        if len(raw) < 16 or raw[:8] != _MAGIC or int.from_bytes(raw[8:12], "little") != _VERSION:
            return False
        n = int.from_bytes(raw[12:16], "little")
        try:
            old = json.loads(raw[16:16 + n])
        except ValueError:
            return False
        want = json.loads(json.dumps(header))  # tuples -> lists, as stored
        if old == want:
            return True
        blob = json.dumps(header).encode()
        return old == {"fingerprint": {"digest": xxhash.xxh3_128_hexdigest(blob)}, "layout": want["layout"]}

    def _checksum(self, slot: int) -> int:
        return xxhash.xxh3_64_intdigest(self.data[slot].view(torch.uint8).numpy())

    def _scan(self) -> list[tuple[int, int]]:
        """Valid slots whose checksum matches, oldest store first; one warning for the others."""
        rec = self._records
        found, bad = [], 0
        for slot in np.nonzero(rec[:, 4] == np.uint64(_VALID))[0].tolist():
            lo, hi, csum, seq, _ = (int(x) for x in rec[slot])
            if self._checksum(slot) != csum:
                rec[slot, 4] = 0
                bad += 1
                continue
            found.append((seq, slot, lo | (hi << 64)))
        if bad:
            logger.warning("KV offload file %s: %d block(s) failed their checksum and are ignored", self.path, bad)
        found.sort()
        self._seq = found[-1][0] + 1 if found else 0
        if found:
            logger.info("KV offload file %s: %d block(s) from a previous run reused", self.path, len(found))
        return [(slot, h) for _, slot, h in found]

    def entries(self) -> list[tuple[int, int]]:
        return list(self._entries)

    def _before_write(self, slots: list[int]) -> None:
        self._records[slots, 4] = 0

    def _after_write(self, slot_hashes: list[tuple[int, int]]) -> None:
        rec = self._records
        mask = (1 << 64) - 1
        for slot, h in slot_hashes:
            rec[slot, 0] = h & mask
            rec[slot, 1] = h >> 64
            rec[slot, 2] = self._checksum(slot)
            rec[slot, 3] = self._seq
            self._seq += 1
        for slot, _ in slot_hashes:  # the valid flag last
            rec[slot, 4] = _VALID

    def close(self) -> None:
        self._records = None
        self.data = None
        self._file = None
