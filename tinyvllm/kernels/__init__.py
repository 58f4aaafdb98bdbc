"""Compute kernels, with no knowledge of the engine: the C++ CPU kernels (:mod:`tinyvllm.kernels.cpu`)
and the Triton GPU kernels (:mod:`tinyvllm.kernels.triton`).

Layering: this package imports nothing of tinyvllm but :mod:`tinyvllm.envs`; the attention backends
(:mod:`tinyvllm.attention`) build on it.
"""
