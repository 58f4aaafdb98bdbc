"""Attention backends over a paged KV cache: one per kind of kernels, chosen once per engine.

* :mod:`~tinyvllm.attention.base`: the :class:`~tinyvllm.attention.base.AttentionBackend` interface;
* :mod:`~tinyvllm.attention.cpu`: the C++ CPU kernels (:mod:`tinyvllm.kernels.cpu`);
* :mod:`~tinyvllm.attention.triton`: the Triton kernels (:mod:`tinyvllm.kernels.triton`), GPU;
* :mod:`~tinyvllm.attention.torch_ref`: the pure-PyTorch float64 reference;
* :mod:`~tinyvllm.attention.selector`: :func:`~tinyvllm.attention.selector.get_attn_backend`.

The KV cache of one layer is a tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]``
(PagedAttention, Kwon et al., SOSP 2023). A token's *slot* is ``block_id * block_size + offset``;
a sequence's *block table* lists its physical blocks in logical order.

Layering: this package imports only :mod:`tinyvllm.kernels` and :mod:`tinyvllm.envs`.
"""
