"""Weight loading: build a :class:`~tinyvllm.model.llama.LlamaForCausalLM` from an HF-style directory
(:func:`load_model`), copy HF-named tensors into its fused parameters (:func:`load_weights`), or fill
it with seeded random weights (:func:`init_dummy_weights`, ``--load-format dummy``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

import torch

from tinyvllm.config import LOAD_FORMATS
from tinyvllm.model.layers import rope_inv_freq
from tinyvllm.model.llama import LlamaConfig, LlamaForCausalLM


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) into ``model``.

    Q/K/V are packed into ``qkv_proj`` and gate/up into ``gate_up_proj``.

    Raises:
        ValueError: an unexpected tensor name or shape, or missing tensors.
        RuntimeError: the weights were already packed by ``model.pack_for_cpu``.
    """
    if model.packed:
        raise RuntimeError("weights are packed for the CPU GEMM (pack_for_cpu); build a new model to load weights")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    shard = {
        "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
    }
    for name, tensor in weights:
        if "rotary_emb.inv_freq" in name:
            continue
        n = name[len("model."):] if name.startswith("model.") else name
        if n == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        parts = n.split(".")
        target, offset, size = n, None, None
        if len(parts) >= 2 and parts[-2] in shard:
            fused, offset, size = shard[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
        if target not in params:
            raise ValueError(f"unexpected weight {name!r} (no parameter {target!r})")
        p = params[target]
        with torch.no_grad():
            dst = p.data if offset is None else p.data.narrow(0, offset, size)
            if dst.shape != tensor.shape:
                raise ValueError(f"weight {name!r}: shape {tuple(tensor.shape)} != expected {tuple(dst.shape)}")
            dst.copy_(tensor)
        loaded.add(f"{target}@{offset}")
    expected = 0
    for pname in params:
        if "qkv_proj" in pname:
            expected += 3
        elif "gate_up_proj" in pname:
            expected += 2
        else:
            expected += 1
    if len(loaded) != expected:
        raise ValueError(f"model weights incomplete: loaded {len(loaded)} of {expected} tensors")



def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Fill ``model`` with seeded random weights (vLLM's ``--load-format dummy``), on its own device.

    Linear weights ~ N(0, 1/in_features) so activations stay O(1) through any depth;
    the embedding ~ N(0, 0.02^2) (Hugging Face's ``initializer_range``); RMSNorm weights 1;
    biases 0. Outputs are meaningless but finite, which is all a speed measurement needs.
    """
    dev = next(model.parameters()).device
    g = torch.Generator(device=dev)
    g.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2 and "embed_tokens" in name:
                p.normal_(0.0, 0.02, generator=g)
            elif p.dim() == 2:
                p.normal_(0.0, p.shape[1] ** -0.5, generator=g)
            elif name.endswith("bias"):
                p.zero_()
            else:  # RMSNorm weights
                p.fill_(1.0)


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu", *,
               load_format: str = "auto", seed: int = 0) -> LlamaForCausalLM:
    """Build a :class:`LlamaForCausalLM` from an HF-style directory of safetensors.

    Args:
        load_format: ``auto`` reads ``*.safetensors``; ``dummy`` reads only ``config.json``
            and fills the weights with :func:`init_dummy_weights` (``seed``).

    The weights are not packed for the CPU GEMM here: binding the C++ attention backend does that
    (:meth:`LlamaForCausalLM.bind_attn_backend`).

    Raises:
        ValueError: unsupported config or mismatched weights; unknown ``load_format``.
    """
    from safetensors import safe_open

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    model_dir = Path(model_dir)
    cfg = LlamaConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = model.to_empty(device=device).to(dtype)
    # Buffers built on the meta device must be recomputed.
    model.rotary.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling).to(device)
    files = sorted(model_dir.glob("*.safetensors"))

    def weights() -> Iterable[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    yield key, fh.get_tensor(key)

    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        load_weights(model, weights())
    model.eval()
    return model
