"""Model registry: architecture name -> model class (vLLM's ``model_executor/models/registry.py``).

A Hugging Face ``config.json`` names its class in ``architectures`` (``Qwen3ForCausalLM``); a GGUF
file names its architecture in ``general.architecture`` (``qwen3``), which the GGUF converter
(:mod:`tinyvllm.model.loader`) turns into the HF name through :data:`GGUF_ARCHITECTURES`. Each family
is one module of :mod:`tinyvllm.model`, imported when first used; adding one is a file plus a line here.

An architecture that is not here is refused in one line that names it and lists the supported ones
(:class:`UnsupportedArchitectureError`), never run as a (silently wrong) Llama.
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

from tinyvllm.model.errors import UnsupportedArchitectureError, UnsupportedConfigError

# HF architecture name -> (module under tinyvllm.model, class name)
MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("mistral", "MistralForCausalLM"),
    "Qwen2ForCausalLM": ("qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Qwen3MoeForCausalLM": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "SmolLM3ForCausalLM": ("smollm3", "SmolLM3ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma3", "Gemma3ForCausalLM"),
}

# HF ``model_type`` -> architecture, for a config.json without ``architectures``
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
}

# GGUF ``general.architecture`` (llama.cpp's LLM_ARCH names) -> HF architecture
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM", "smollm3": "SmolLM3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
}


ROPE_TYPES = ("default", "linear", "llama3")
"""The rope scaling types :func:`tinyvllm.model.layers.rope_inv_freq` computes."""


def supported_architectures() -> list[str]:
    return sorted(MODELS)


def resolve_architecture(config: dict[str, Any]) -> str:
    """The registered architecture of an HF config dict (its first ``architectures`` entry we know,
    else its ``model_type``).

    Raises:
        UnsupportedArchitectureError: neither is registered.
    """
    archs = config.get("architectures") or []
    for a in archs:
        if a in MODELS:
            return a
    mt = config.get("model_type")
    if not archs and mt in MODEL_TYPES:
        return MODEL_TYPES[mt]
    name = archs[0] if archs else mt
    raise UnsupportedArchitectureError(
        f"unsupported model architecture {name!r} (supported: {', '.join(supported_architectures())})")


def _rope_types(config: dict[str, Any]) -> list[str]:
    rp = config.get("rope_parameters") or {}
    dicts = [config.get("rope_scaling") or {}]
    dicts += [v for v in rp.values() if isinstance(v, dict)] if any(isinstance(v, dict) for v in rp.values()) else [rp]
    return [d.get("rope_type", d.get("type", "default")) for d in dicts if d]


def check_config(config: dict[str, Any]) -> str:
    """Refuse, before any weights load or process starts, what no family here runs; pure Python (no torch
    import: it runs in the API process at start). Returns the registered architecture.

    Raises:
        UnsupportedArchitectureError: an unregistered architecture (named, with the supported ones).
        UnsupportedConfigError: an unsupported rope scaling type or attention variant (named).
    """
    arch = resolve_architecture(config)
    for rt in _rope_types(config):
        if rt not in ROPE_TYPES:
            raise UnsupportedConfigError(
                f"unsupported rope_scaling type {rt!r} in {arch} config (supported: {', '.join(ROPE_TYPES)})")
    if config.get("attn_logit_softcapping") is not None:
        raise UnsupportedConfigError(f"unsupported attention variant in {arch} config: attn_logit_softcapping")
    return arch


def model_class(arch: str) -> type:
    """The model class of a registered architecture name (imports its module)."""
    if arch not in MODELS:
        raise UnsupportedArchitectureError(
            f"unsupported model architecture {arch!r} (supported: {', '.join(supported_architectures())})")
    module, cls = MODELS[arch]
    return getattr(importlib.import_module(f"tinyvllm.model.{module}"), cls)


def config_from_dict(config: dict[str, Any]) -> tuple[type, Any]:
    """``(model class, its parsed config)`` of an HF config dict.

    Raises:
        UnsupportedArchitectureError: an unregistered architecture.
        ValueError: an unsupported config feature (rope scaling type, attention variant), named.
    """
    cls = model_class(resolve_architecture(config))
    return cls, cls.config_class.from_dict(config)


def config_from_dir(model_dir: str | Path) -> tuple[type, Any]:
    """:func:`config_from_dict` of ``model_dir/config.json``."""
    return config_from_dict(json.loads((Path(model_dir) / "config.json").read_text()))
