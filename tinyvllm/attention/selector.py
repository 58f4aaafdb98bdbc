"""Choose the attention backend once per engine: :func:`get_attn_backend`."""

from __future__ import annotations

import logging

import torch

from tinyvllm import envs
from tinyvllm.attention.base import AttentionBackend
from tinyvllm.attention.cpu import CpuAttentionBackend
from tinyvllm.attention.torch_ref import TorchAttentionBackend
from tinyvllm.kernels.cpu import cpu_kernels

logger = logging.getLogger("tinyvllm")
CPU_KERNEL_DTYPES = (torch.bfloat16, torch.float32)
_CHOICES = ("auto", "cpu", "torch", "triton")


def get_attn_backend(device: torch.device | str, dtype: torch.dtype) -> AttentionBackend:
    """The attention backend for a model of ``dtype`` on ``device``.

    CUDA: the Triton kernels. CPU: ``TINYVLLM_ATTENTION`` if set (``cpu``, old name ``cpp``; ``torch``:
    no C++ at all, weights not packed; ``triton``: the Triton kernels, under ``TRITON_INTERPRET=1``, for
    tests), else (``auto``) the C++ kernels when they build and ``dtype`` is bfloat16/float32, else the
    PyTorch float64 reference.
    An unknown ``TINYVLLM_ATTENTION`` value is warned about and treated as ``auto``.
    """
    device = torch.device(device)
    choice = envs.TINYVLLM_ATTENTION
    choice = "cpu" if choice == "cpp" else choice
    if choice not in _CHOICES:
        logger.warning("TINYVLLM_ATTENTION=%s is not one of %s; choosing automatically", choice, ", ".join(_CHOICES))
        choice = "auto"
    if device.type == "cuda" or choice == "triton":
        from tinyvllm.attention.triton import TritonAttentionBackend  # imports triton

        return TritonAttentionBackend(device)
    if choice == "torch":
        return TorchAttentionBackend(device)
    kernels = cpu_kernels() if dtype in CPU_KERNEL_DTYPES else None
    if kernels is None:
        if choice == "cpu":
            logger.warning("TINYVLLM_ATTENTION=cpu: the C++ kernels are unavailable for %s; using the PyTorch "
                           "float64 reference", dtype)
        return TorchAttentionBackend(device)
    return CpuAttentionBackend(kernels, device)
