"""Paged attention over a packed batch: the PyTorch (CPU) backend.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads,
head_dim]`` (PagedAttention, Kwon et al., SOSP 2023). A token's *slot* is
``block_id * block_size + offset``; a sequence's *block table* lists its physical
blocks in logical order.

Exactness: the score, softmax and value reductions run in float64 and are
rounded once to the model dtype. Their float64 summation order may depend on the
shapes of the batch, but the error that leaves is ~1e-16 relative, far below one
bfloat16/float32 ulp, so a query row's output does not depend on what else is in
the batch, on how its prompt was chunked, or on whether its prefix came from the
cache — greedy outputs are batch invariant (see DESIGN.md).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("tinyvllm")
_KERNEL: object | None = None
_KERNEL_TRIED = False


def cpu_kernel():
    """The compiled C++ paged-attention kernel (``cpu_kernel.cpp``), or None if unavailable.

    Built once with ``torch.utils.cpp_extension`` into ``$TINYVLLM_CACHE/torch_extensions``.
    ``TINYVLLM_ATTENTION=torch`` disables it (pure-PyTorch float64 path).
    """
    global _KERNEL, _KERNEL_TRIED
    if _KERNEL_TRIED:
        return _KERNEL
    _KERNEL_TRIED = True
    if os.environ.get("TINYVLLM_ATTENTION", "cpp") == "torch":
        return None
    try:
        from torch.utils.cpp_extension import load

        from tinyvllm.model.loader import cache_root

        srcs = [Path(__file__).with_name("cpu_kernel.cpp"), Path(__file__).with_name("cpu_gemm.cpp")]
        import hashlib

        cflags = ["-O3", "-march=native", "-ffp-contract=off", "-fopenmp"]
        # -march=native: the build is only valid on this kind of CPU, so its flags are part of the key.
        cpu = ""
        try:
            cpu = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("flags")), "")
        except OSError:
            pass
        # The build records absolute paths (sources, the venv's torch headers): checkouts or venvs sharing
        # one cache would otherwise overwrite each other's build and recompile (~30 s) on every switch.
        where = f"{Path(__file__).resolve().parent}|{Path(torch.__file__).resolve().parent}"
        tag = hashlib.sha256(b"".join(f.read_bytes() for f in srcs) + " ".join(cflags).encode()
                             + cpu.encode() + where.encode()).hexdigest()[:10]
        build = cache_root() / "torch_extensions" / f"cpu_kernels-torch{torch.__version__.split('+')[0]}-{tag}"
        build.mkdir(parents=True, exist_ok=True)
        _KERNEL = load(name=f"tinyvllm_cpu_kernels_{tag}", sources=[str(f) for f in srcs],
                       extra_cflags=cflags,
                       extra_ldflags=["-fopenmp"], build_directory=str(build), verbose=False)
    except Exception as e:  # no compiler, no ninja...
        logger.warning("C++ paged attention kernel unavailable (%s); using the PyTorch float64 path", e)
        _KERNEL = None
    return _KERNEL


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, shared by all layers.

    Sequences are packed in order: sequence ``i``'s new tokens are
    ``tokens[query_start_loc[i]:query_start_loc[i+1]]`` and sit at positions
    ``seq_lens[i] - q_len_i ... seq_lens[i] - 1``.

    Attributes:
        slot_mapping: [num_tokens] int64 cache slot of each new token.
        query_start_loc: [num_seqs + 1] python ints (cumulative new-token counts).
        seq_lens: [num_seqs] python ints, context length incl. this step's tokens.
        block_tables: [num_seqs, max_blocks] int64 physical block ids (0-padded).
        block_size: tokens per block.
        decode_*: the batched path for sequences with exactly one new token:
            ``decode_seq_ids`` (python ints), ``decode_token_idx`` [Sd] int64,
            ``decode_slots`` [Sd, Lmax] int64 slots of every context position,
            ``decode_mask`` [Sd, Lmax] bool (True = attend).
        prefill_seq_ids: python ints of sequences with more than one new token.
        token_seq, token_pos: [num_tokens] int64 sequence index and position of each
            new token (the C++ CPU kernel).
        seq_lens_tensor, query_start_loc_tensor: int32 device copies of ``seq_lens``
            and ``query_start_loc`` (the Triton backend, :func:`use_triton`).
        decode_only: every sequence has exactly one new token.

    With the Triton backend (:func:`use_triton`) only ``slot_mapping``,
    ``block_tables``, the two int32 tensors and ``decode_only`` are filled; the
    CPU-path fields are left empty (``token_seq`` None).
    """

    slot_mapping: torch.Tensor
    query_start_loc: list[int]
    seq_lens: list[int]
    block_tables: torch.Tensor
    block_size: int
    decode_seq_ids: list[int]
    decode_token_idx: torch.Tensor
    decode_slots: torch.Tensor
    decode_mask: torch.Tensor
    prefill_seq_ids: list[int]
    prefill_slots: list[torch.Tensor]
    token_seq: torch.Tensor | None = None
    token_pos: torch.Tensor | None = None
    seq_lens_tensor: torch.Tensor | None = None
    query_start_loc_tensor: torch.Tensor | None = None
    decode_only: bool = False

    @classmethod
    def for_triton(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, block_size: int,
                   seq_lens_tensor: torch.Tensor, query_start_loc_tensor: torch.Tensor, decode_only: bool,
                   query_start_loc: list[int] | None = None, seq_lens: list[int] | None = None
                   ) -> "AttentionMetadata":
        """Metadata of the Triton backend: device tensors only (``slot_mapping`` [T] int64,
        ``block_tables`` [S, max_blocks] int64, ``seq_lens_tensor`` [S] and ``query_start_loc_tensor``
        [S+1] int32), the CPU-path fields left empty. The CUDA-graph runner passes its static buffers."""
        empty = torch.zeros(0, dtype=torch.int64, device=slot_mapping.device)
        return cls(
            slot_mapping=slot_mapping, query_start_loc=query_start_loc or [], seq_lens=seq_lens or [],
            block_tables=block_tables, block_size=block_size, decode_seq_ids=[], decode_token_idx=empty,
            decode_slots=empty.view(0, 1), decode_mask=torch.zeros(0, 1, dtype=torch.bool, device=empty.device),
            prefill_seq_ids=[], prefill_slots=[], seq_lens_tensor=seq_lens_tensor,
            query_start_loc_tensor=query_start_loc_tensor, decode_only=decode_only,
        )

    @classmethod
    def build(cls, query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu") -> "AttentionMetadata":
        """Build metadata from per-sequence query lengths, context lengths and block tables.

        Raises:
            ValueError: a block table too short for its sequence length.
        """
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        max_blocks = max((len(b) for b in block_tables), default=1) or 1
        bt = torch.zeros(len(block_tables), max_blocks, dtype=torch.int64)
        for i, b in enumerate(block_tables):
            if len(b) * block_size < seq_lens[i]:
                raise ValueError(f"sequence {i}: {len(b)} blocks cannot hold {seq_lens[i]} tokens")
            if b:
                bt[i, : len(b)] = torch.tensor(b, dtype=torch.int64)
        # Slot of every context position of every sequence: [S, max_blocks * block_size].
        offs = torch.arange(block_size, dtype=torch.int64)
        all_slots = (bt[:, :, None] * block_size + offs[None, None, :]).reshape(len(block_tables), -1)
        slot_chunks = []
        for i, (q, s) in enumerate(zip(query_lens, seq_lens)):
            slot_chunks.append(all_slots[i, s - q: s])
        slot_mapping = torch.cat(slot_chunks) if slot_chunks else torch.zeros(0, dtype=torch.int64)
        if use_triton(device):
            return cls.for_triton(slot_mapping.to(device), bt.to(device), block_size,
                                  torch.tensor(seq_lens, dtype=torch.int32).to(device),
                                  torch.tensor(qsl, dtype=torch.int32).to(device),
                                  all(q == 1 for q in query_lens), qsl, list(seq_lens))

        dec = [i for i, q in enumerate(query_lens) if q == 1]
        pre = [i for i, q in enumerate(query_lens) if q > 1]
        # Padded gather indices serve only the PyTorch fallback; the C++ kernel reads the block table.
        fallback = cpu_kernel() is None
        if dec and fallback:
            lmax = max(seq_lens[i] for i in dec)
            idx = torch.tensor(dec, dtype=torch.int64)
            decode_slots = all_slots[idx, :lmax].clone()
            lens = torch.tensor([seq_lens[i] for i in dec], dtype=torch.int64)
            decode_mask = torch.arange(lmax)[None, :] < lens[:, None]
            decode_slots[~decode_mask] = 0
            decode_token_idx = torch.tensor([qsl[i] for i in dec], dtype=torch.int64)
        else:
            decode_slots = torch.zeros(0, 1, dtype=torch.int64)
            decode_mask = torch.zeros(0, 1, dtype=torch.bool)
            decode_token_idx = torch.zeros(0, dtype=torch.int64)
        prefill_slots = [all_slots[i, : seq_lens[i]].clone() for i in pre] if fallback else []
        token_seq = torch.repeat_interleave(torch.arange(len(query_lens)), torch.tensor(query_lens, dtype=torch.int64))
        token_pos = torch.cat([torch.arange(s - q, s) for q, s in zip(query_lens, seq_lens)]) if query_lens \
            else torch.zeros(0, dtype=torch.int64)
        return cls(
            slot_mapping=slot_mapping.to(device),
            query_start_loc=qsl,
            seq_lens=list(seq_lens),
            block_tables=bt.to(device),
            block_size=block_size,
            decode_seq_ids=dec if fallback else [],
            decode_token_idx=decode_token_idx.to(device),
            decode_slots=decode_slots.to(device),
            decode_mask=decode_mask.to(device),
            prefill_seq_ids=pre if fallback else [],
            prefill_slots=[p.to(device) for p in prefill_slots],
            token_seq=token_seq.to(device),
            token_pos=token_pos.to(device),
            decode_only=not pre,
        )


def use_triton(device: torch.device | str) -> bool:
    """Whether attention on ``device`` runs the Triton backend: always on CUDA; on the CPU only
    with ``TINYVLLM_ATTENTION=triton`` (the kernels then need ``TRITON_INTERPRET=1``; for tests)."""
    return torch.device(device).type == "cuda" or os.environ.get("TINYVLLM_ATTENTION") == "triton"


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hk, D] into ``kv_cache`` [2, num_blocks, block_size, Hk, D] at ``slot_mapping`` [T]."""
    hk, d = kv_cache.shape[-2], kv_cache.shape[-1]
    kv_cache[0].view(-1, hk, d).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, hk, d).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked softmax attention in float64.

    Args:
        q: [S, Q, Hk, G, D] queries (G = query heads per KV head).
        k, v: [S, L, Hk, D] keys and values.
        mask: [S, Q, L] bool, True where query may attend to key.
    Returns:
        [S, Q, Hk, G, D] float64.
    """
    qd = q.double()
    kd = k.double()
    vd = v.double()
    scores = torch.einsum("sqhgd,slhd->shgql", qd, kd) * scale
    scores = scores.masked_fill(~mask[:, None, None, :, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("shgql,slhd->sqhgd", probs, vd)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over each sequence's context.

    Args:
        q: [T, Hq, D] queries of the packed batch.
        k, v: [T, Hk, D] new keys and values.
        kv_cache: [2, num_blocks, block_size, Hk, D] this layer's cache.
        md: step metadata.
        scale: softmax scale (usually D ** -0.5).
    Returns:
        [T, Hq, D] attention output, dtype of ``q``.
    """
    if use_triton(q.device):
        from tinyvllm.attention import triton_backend  # lazy: imports triton

        return triton_backend.paged_attention(q, k, v, kv_cache, md, scale)
    T, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    write_kv(kv_cache, k, v, md.slot_mapping)
    kern = cpu_kernel() if q.device.type == "cpu" else None
    if kern is not None:
        out = kern.paged_attention(q.float(), kv_cache[0], kv_cache[1], md.block_tables, md.token_seq,
                                   md.token_pos, scale)
        return out.to(q.dtype)
    kc = kv_cache[0].view(-1, hk, d)
    vc = kv_cache[1].view(-1, hk, d)
    out = torch.empty(T, hq, d, dtype=q.dtype, device=q.device)
    if md.decode_seq_ids:
        qd = q.index_select(0, md.decode_token_idx).reshape(-1, 1, hk, g, d)
        kd = kc[md.decode_slots]  # [Sd, L, Hk, D]
        vd = vc[md.decode_slots]
        o = _attend(qd, kd, vd, md.decode_mask[:, None, :], scale)
        out.index_copy_(0, md.decode_token_idx, o.reshape(-1, hq, d).to(q.dtype))
    for j, i in enumerate(md.prefill_seq_ids):
        start, end = md.query_start_loc[i], md.query_start_loc[i + 1]
        ql, sl = end - start, md.seq_lens[i]
        slots = md.prefill_slots[j]
        kp = kc[slots][None]
        vp = vc[slots][None]
        qpos = torch.arange(sl - ql, sl, device=q.device)
        mask = (torch.arange(sl, device=q.device)[None, :] <= qpos[:, None])[None]
        o = _attend(q[start:end].reshape(1, ql, hk, g, d), kp, vp, mask, scale)
        out[start:end] = o.reshape(ql, hq, d).to(q.dtype)
    return out
