"""Triton kernels of the GPU path (also run on CPU tensors under ``TRITON_INTERPRET=1``, for tests).

* :mod:`tinyvllm.kernels.triton.attention`: paged attention (decode, prefill) and the KV-cache store;
* :mod:`tinyvllm.kernels.triton.ops`: fused RMSNorm (+ residual add) and rotary embedding.

Import those modules explicitly: this package itself does not import ``triton``, so importing
tinyvllm never does.
"""
