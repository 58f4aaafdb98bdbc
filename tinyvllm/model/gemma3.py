"""Gemma 3 text (Gemma Team 2025; 270M, 1B, and the text stack of 4B-27B): what differs from Llama.

* **Embedding scaled** by sqrt(hidden) (in the model dtype, as HF's ``Gemma3TextScaledWordEmbedding``).
* **Four norms per block**: ``input_layernorm`` -> attention -> ``post_attention_layernorm`` -> + residual
  -> ``pre_feedforward_layernorm`` -> MLP -> ``post_feedforward_layernorm`` -> + residual.
* **(1 + w) RMSNorm** everywhere (also q/k norms), HF's ``Gemma3RMSNorm``: ``w`` is stored in the model
  dtype as in the checkpoint, ``1 + w`` is formed in float32 at bind time (:meth:`Gemma3ForCausalLM.make_plan`),
  and the normalised row is multiplied by it in float32 and rounded once (:func:`gemma_rms_norm`;
  Llama's norm rounds the normalised row first, then multiplies by a weight in the model dtype:
  in bfloat16 that is two more roundings and a ``1 + w`` rounded to 8 bits). float32 models keep the
  backend's fused norm (the same arithmetic there). llama.cpp's GGUF stores ``1 + w`` (the converter
  subtracts 1 to write an HF directory).
* **Per-head q/k RMSNorm** before RoPE (as Qwen3).
* **GeGLU**: ``gelu_pytorch_tanh(gate) * up`` (:func:`~tinyvllm.model.layers.gelu_tanh_and_mul`, a torch op).
* **Query scaling** by ``query_pre_attn_scalar ** -0.5`` instead of head_dim ** -0.5.
* **Local and global layers** (``layer_types``; by default 5 sliding-window layers then 1 global): each
  kind has its own rope base (local 10 000; global 1 000 000, with the config's scaling where set).
* **Sliding window** (512 in 1B, 1024 in 4B+) on the local layers: their attention sees the last
  ``sliding_window`` positions (keys ``p - sliding_window + 1 .. p``, transformers' convention), on every
  backend (:class:`~tinyvllm.model.layers.Attention` ``window``). The context runs to
  ``max_position_embeddings`` (32K in 1B). Blocks before the window are skipped by the local layers'
  kernels, not freed: the global layers read the whole context.
* Optional ``final_logit_softcapping`` (``tanh(x / c) * c``; null in Gemma 3). ``attn_logit_softcapping``
  (Gemma 2) is refused: no kernel softcaps scores.

HF: ``Gemma3ForCausalLM`` (``model_type`` ``gemma3_text``); vLLM ``gemma3.py``. GGUF: llama.cpp's ``gemma3``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from tinyvllm.model.layers import Attention, GatedMLP, RMSNorm, RotaryEmbedding, rope_inv_freq
from tinyvllm.model.llama import LlamaConfig, LlamaForCausalLM, read_rope


def gemma_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                   eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma's RMSNorm (transformers ``Gemma3RMSNorm``): ``(x * rsqrt(mean(x^2) + eps) * weight)`` in float32,
    rounded once to ``x``'s dtype. ``x`` [T, H]; ``weight`` [H] float32, already ``1 + w``. With
    ``residual`` [T, H], first ``x = x + residual`` in the model dtype. Returns ``(normed, x)``. Row-wise
    torch ops: a row's result does not depend on the other rows (batch invariant)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    return (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight).to(x.dtype), x


@dataclass
class Gemma3Config(LlamaConfig):
    query_pre_attn_scalar: float = 256.0
    sliding_window: int | None = None
    layer_types: list[str] = field(default_factory=list)  # "sliding_attention" | "full_attention" per layer
    rope_local_theta: float = 10000.0
    rope_local_scaling: dict[str, Any] | None = None
    final_logit_softcapping: float | None = None

    @classmethod
    def extra_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        if d.get("attn_logit_softcapping") is not None:
            raise ValueError("unsupported attention variant: attn_logit_softcapping (Gemma 2 style score "
                             "softcapping) has no kernel here")
        act = d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh"
        if act != "gelu_pytorch_tanh":
            raise ValueError(f"unsupported Gemma 3 hidden_activation {act!r} (supported: gelu_pytorch_tanh)")
        n = int(d["num_hidden_layers"])
        types = d.get("layer_types")
        if not types:
            pattern = int(d.get("sliding_window_pattern", d.get("_sliding_window_pattern", 6)))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
        if len(types) != n or set(types) - {"sliding_attention", "full_attention"}:
            raise ValueError(f"Gemma 3 config: layer_types must name sliding_attention/full_attention for "
                             f"each of the {n} layers, got {types!r}")
        rp = d.get("rope_parameters") or {}
        local = rp.get("sliding_attention") if isinstance(rp.get("sliding_attention"), dict) else None
        if local is not None:
            local_theta, local_scaling = read_rope({"rope_parameters": local})
        else:
            local_theta, local_scaling = float(d.get("rope_local_base_freq", 10000.0)), None
        rope_inv_freq(2, local_theta, local_scaling)  # refuse an unsupported rope type at load
        return {"query_pre_attn_scalar": float(d.get("query_pre_attn_scalar", d.get("head_dim", 256))),
                "sliding_window": d.get("sliding_window"), "layer_types": list(types),
                "rope_local_theta": local_theta, "rope_local_scaling": local_scaling,
                "final_logit_softcapping": d.get("final_logit_softcapping")}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Gemma3Config":
        rp = d.get("rope_parameters") or {}
        if isinstance(rp.get("full_attention"), dict):  # transformers 5: one rope dict per layer type
            d = {**d, "rope_parameters": rp["full_attention"]}
        d = {"head_dim": 256, **d}
        cfg = super().from_dict(d)
        if "sliding_attention" in cfg.layer_types and not (cfg.sliding_window and int(cfg.sliding_window) > 0):
            raise ValueError(f"Gemma 3 config: sliding_attention layers need a positive sliding_window, "
                             f"got {cfg.sliding_window!r}")
        return cfg


class Gemma3Attention(Attention):
    """Gemma's q/k norms: (1 + w) in float32 (:func:`gemma_rms_norm`) where the model is not float32."""

    norm_fn: Any = None  # set by Gemma3ForCausalLM.make_plan
    q_weight: torch.Tensor | None = None
    k_weight: torch.Tensor | None = None

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        t, d, qs, ks = qkv.shape[0], self.head_dim, self.q_size, self.kv_size
        q = self.norm_fn(qkv[:, :qs].reshape(-1, d).contiguous(), None, self.q_weight, self.q_norm.eps)[0]
        k = self.norm_fn(qkv[:, qs:qs + ks].reshape(-1, d).contiguous(), None, self.k_weight, self.k_norm.eps)[0]
        return torch.cat([q.reshape(t, qs), k.reshape(t, ks), qkv[:, qs + ks:]], dim=1)


class Gemma3DecoderLayer(nn.Module):
    """Gemma 3's block weights: four (1 + w) norms around attention and MLP."""

    def __init__(self, cfg: Gemma3Config, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = Gemma3Attention(h, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                                   qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias,
                                   scale=cfg.query_pre_attn_scalar ** -0.5, qk_norm_eps=eps,
                                   rope_index=int(cfg.layer_types[index] == "sliding_attention"),
                                   window=int(cfg.sliding_window) if cfg.layer_types[index] == "sliding_attention" else 0)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, cfg.intermediate_size, act="gelu_tanh")
        self.post_feedforward_layernorm = RMSNorm(h, eps)


class Gemma3ForCausalLM(LlamaForCausalLM):
    config_class = Gemma3Config

    def make_layer(self, cfg: Gemma3Config, index: int) -> nn.Module:
        return Gemma3DecoderLayer(cfg, index)

    def make_rotaries(self, cfg: Gemma3Config) -> list[RotaryEmbedding]:
        """[global (``rope_theta``, the config's scaling), local (``rope_local_theta``)]."""
        return [RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling),
                RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta,
                                cfg.rope_local_scaling)]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = super().embed(input_ids)
        return x * torch.tensor(self.config.hidden_size ** 0.5, dtype=x.dtype)

    def remap_weight(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        if name.startswith("model.language_model."):  # Gemma3ForConditionalGeneration's text stack
            name = "model." + name[len("model.language_model."):]
        yield name, tensor

    def make_plan(self) -> list[tuple]:
        """As Llama's, with each norm's ``1 + w`` in float32 and the norm function: the backend's fused
        norm for a float32 model, :func:`gemma_rms_norm` otherwise (HF's rounding)."""
        be = self._binding_backend
        self._norm_fn = be.rms_norm if self.embed_tokens.weight.dtype == torch.float32 else gemma_rms_norm
        w1 = lambda norm: 1.0 + norm.weight.detach().float()  # noqa: E731
        self._final_w = w1(self.norm)
        for layer in self.layers:
            a = layer.self_attn
            a.norm_fn, a.q_weight, a.k_weight = self._norm_fn, w1(a.q_norm), w1(a.k_norm)
        return [(w1(layer.input_layernorm), layer.input_layernorm.eps, layer.self_attn.forward_paged,
                 w1(layer.post_attention_layernorm), layer.post_attention_layernorm.eps,
                 w1(layer.pre_feedforward_layernorm), layer.pre_feedforward_layernorm.eps, layer.mlp.forward_paged,
                 w1(layer.post_feedforward_layernorm), layer.post_feedforward_layernorm.eps)
                for layer in self.layers]

    def bind_attn_backend(self, backend: Any) -> None:
        self._binding_backend = backend  # make_plan (called by the base) picks the norm by it
        super().bind_attn_backend(backend)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                md: Any) -> torch.Tensor:
        """As :meth:`LlamaForCausalLM.forward` ([T] ids and positions -> [T, hidden]), with Gemma's
        post-attention and post-MLP norms applied to each branch before its residual add."""
        be = self.attn_backend
        if be is None:
            raise RuntimeError("no attention backend bound: call bind_attn_backend(get_attn_backend(device, dtype))")
        norm = self._norm_fn
        ropes = [be.rope_inputs(r, positions) for r in self.rotaries]
        x = self.embed(input_ids)
        residual = None
        for (ln1, e1, attn, ln2, e2, ln3, e3, mlp, ln4, e4), kv in zip(self._plan, kv_caches):
            h, residual = norm(x, residual, ln1, e1)
            h = norm(attn(h, kv, md, ropes), None, ln2, e2)[0]
            h, residual = norm(h, residual, ln3, e3)
            x = norm(mlp(h), None, ln4, e4)[0]
        return norm(x, residual, self._final_w, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.config.final_logit_softcapping
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits
