"""Paged attention over a packed batch: the Triton (GPU) backend.

Same contract as :func:`tinyvllm.attention.backend.paged_attention`, which
dispatches here when ``q`` is on CUDA (or, for tests on the CPU under
``TRITON_INTERPRET=1``, when ``TINYVLLM_ATTENTION=triton``):

1. :func:`~tinyvllm.attention.triton_kernels.reshape_and_cache` writes this
   step's K/V rows into their slots (slot ``-1`` rows are skipped: CUDA-graph
   padding);
2. a decode-only batch (every sequence has one new token, so token ``i`` is
   sequence ``i``) runs :func:`~tinyvllm.attention.triton_kernels.paged_decode_attention`
   (split-K flash-decoding); anything else - prefill chunks, mixed steps - runs
   :func:`~tinyvllm.attention.triton_kernels.paged_prefill_attention`, which
   attends over each sequence's cached prefix and causally within its chunk.

Both read the context only through the block table, so prefix-cached blocks
and chunked prefill need nothing special.  Nothing here reads device values on
the host, so a decode step can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch

from tinyvllm.attention.backend import AttentionMetadata


def _kernels():
    # Attribute access at call time (not ``from ... import f``) so that a test's
    # ``importlib.reload`` of the kernels module (interpreter vs compiled) is seen.
    from tinyvllm.attention import triton_kernels

    return triton_kernels


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    md: AttentionMetadata, scale: float) -> torch.Tensor:
    """Write this step's K/V into the paged cache, then attend over each sequence's context.

    Args:
        q: [T, Hq, D] queries of the packed batch (the KV cache's dtype).
        k, v: [T, Hk, D] new keys and values.
        kv_cache: [2, num_blocks, block_size, Hk, D] this layer's cache.
        md: step metadata with ``slot_mapping``, ``block_tables``, ``seq_lens_tensor``
            and ``query_start_loc_tensor`` (int32) on ``q``'s device, and ``decode_only``.
        scale: softmax scale.
    Returns:
        [T, Hq, D] attention output, dtype of ``q``.

    Raises:
        RuntimeError: CPU tensors while the kernels are compiled (not interpreted).
    """
    tk = _kernels()
    if not q.is_cuda and not tk._interpreting():
        raise RuntimeError("the Triton attention backend got CPU tensors but its kernels are compiled for "
                           "the GPU; set TRITON_INTERPRET=1 before triton is imported to run them on the CPU")
    if md.seq_lens_tensor is None or md.query_start_loc_tensor is None:
        raise ValueError("AttentionMetadata lacks seq_lens_tensor/query_start_loc_tensor: build it with "
                         "AttentionMetadata.build on the device the Triton backend runs on")
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    tk.reshape_and_cache(k, v, key_cache, value_cache, md.slot_mapping)
    if md.decode_only:
        return tk.paged_decode_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens_tensor, scale)
    return tk.paged_prefill_attention(q, key_cache, value_cache, md.block_tables, md.seq_lens_tensor,
                                      md.query_start_loc_tensor, scale)
