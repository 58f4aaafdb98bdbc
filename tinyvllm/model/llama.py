"""Llama architecture (Touvron et al. 2023) over a packed batch with a paged KV cache; the base of the
other families (:mod:`tinyvllm.model.registry`).

All sequences' new tokens are flattened into one ``[num_tokens]`` tensor with
their ``positions``; there is no padding. The model holds the weights and runs
one loop over its layers; the per-layer ops (RMSNorm + residual, RoPE + KV-cache
write + paged attention, the SwiGLU activation) are those of the attention
backend bound once with :meth:`LlamaForCausalLM.bind_attn_backend`
(:mod:`tinyvllm.attention`). Weight loading is in :mod:`tinyvllm.model.weights`.

A family that differs from Llama subclasses :class:`LlamaConfig` (its config fields) and
:class:`LlamaForCausalLM`, overriding :meth:`LlamaForCausalLM.make_layer` (its layer's pieces),
:meth:`LlamaForCausalLM.make_rotaries` (per-layer rotary tables), :meth:`LlamaForCausalLM.embed`,
:meth:`LlamaForCausalLM.remap_weight` (its checkpoint's names and conventions) or, when the block's
wiring differs (Gemma 3's four norms), :meth:`LlamaForCausalLM.forward`.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention.base import AttentionBackend
from tinyvllm.model.layers import (SLAB_ROWS, Attention, Embedding, GatedMLP, Linear,  # noqa: F401 - re-exported
                                   RMSNorm, RotaryEmbedding, batch_invariant_linear, rope_inv_freq)

logger = logging.getLogger("tinyvllm")


@dataclass
class LlamaConfig:
    """The fields of a Hugging Face ``config.json`` that a Llama needs."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    attention_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | list[int] | None = None
    eos_token_id: int | list[int] | None = None

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "LlamaConfig":
        """Read an HF config dict (transformers 4.x ``rope_theta``/``rope_scaling`` or 5.x ``rope_parameters``).

        Which class reads a config is the registry's choice (:func:`tinyvllm.model.registry.resolve_architecture`);
        a family's subclass reads its extra fields in :meth:`extra_fields`.

        Raises:
            ValueError: an unsupported rope scaling type (named, with the supported ones).
        """
        heads = int(d["num_attention_heads"])
        rope_theta, rope_scaling = read_rope(d)
        rope_inv_freq(2, rope_theta, rope_scaling)  # an unsupported rope type fails here, at load, in one line
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(d.get("num_key_value_heads") or heads),
            head_dim=int(d.get("head_dim") or d["hidden_size"] // heads),
            max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=d.get("eos_token_id"),
            **cls.extra_fields(d),
        )

    @classmethod
    def extra_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        """A family's own fields read from the HF config dict ``d`` (none for Llama)."""
        return {}

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "LlamaConfig":
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def cap_to_sliding_window(self, window: int | None, family: str) -> None:
        """Lower ``max_position_embeddings`` to ``window`` where the model attends over a sliding window
        shorter than its context, with a warning: the attention kernels attend over the whole context
        (no window), which equals the window's attention as long as no sequence is longer than the
        window (vLLM's early rule for Mistral). Never a silently wrong model: a longer
        ``max_model_len`` is then refused at start (``EngineCore``)."""
        if window is not None and 0 < int(window) < self.max_position_embeddings:
            logger.warning("%s: sliding_window %d < max_position_embeddings %d; the attention kernels have no "
                           "window, so max_model_len is capped at %d", family, int(window),
                           self.max_position_embeddings, int(window))
            self.max_position_embeddings = int(window)

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


def read_rope(d: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """``(rope_theta, rope_scaling)`` of an HF config dict (transformers 4.x ``rope_theta`` /
    ``rope_scaling``, or 5.x ``rope_parameters``)."""
    rope_params = d.get("rope_parameters") or {}
    rope_theta = float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
    rope_scaling = d.get("rope_scaling")
    if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
        rope_scaling = dict(rope_params)
    return rope_theta, rope_scaling


class LlamaAttention(Attention):
    """Llama's attention: no q/k norm; ``attention_bias`` biases q, k, v and o."""

    def __init__(self, cfg: LlamaConfig, **kw: Any) -> None:
        kw.setdefault("qkv_bias", cfg.attention_bias)
        kw.setdefault("o_bias", cfg.attention_bias)
        super().__init__(cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, **kw)


class LlamaMLP(GatedMLP):
    """SwiGLU feed-forward (Shazeer 2020) weights: ``down(silu(gate(x)) * up(x))``, gate and up fused."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__(cfg.hidden_size, cfg.intermediate_size, bias=cfg.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    """A pre-norm block's weights (the loop is :meth:`LlamaForCausalLM.forward`)."""

    def __init__(self, cfg: LlamaConfig, attn: nn.Module | None = None, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = attn if attn is not None else LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg)


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head (tied to the embedding or separate).

    Call :meth:`bind_attn_backend` once before :meth:`forward`.
    """

    config_class = LlamaConfig

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotaries = nn.ModuleList(self.make_rotaries(cfg))
        self.rotary = self.rotaries[0]
        self.lm_head_packed: torch.Tensor | None = None  # tied head packed for the CPU GEMM (pack_for_cpu)
        self.lm_head_quant: Any = None  # tied head on its GGUF blocks (gguf_quant.attach_gguf_quant)
        self.quantization = "none"  # "gguf" once gguf_quant.attach_gguf_quant ran
        self._kern: Any = None  # the C++ kernels module, once pack_for_cpu packed the weights
        self.attn_backend: AttentionBackend | None = None
        self._plan: list[tuple] = []  # per layer, the tensors and linear layers forward reads (bind_attn_backend)
        # Tensor parallelism (tinyvllm.model.tensor_parallel.shard_model): the group, and this rank's vocab rows
        # [vocab_start, vocab_start + embed_tokens.num_embeddings) of the vocab-parallel embedding and LM head.
        self.tp: Any = None
        self.vocab_start, self.vocab_per_rank = 0, cfg.vocab_size
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def make_layer(self, cfg: LlamaConfig, index: int) -> nn.Module:
        """Layer ``index``'s modules (``input_layernorm``, ``self_attn``, ``post_attention_layernorm``, ``mlp``)."""
        return LlamaDecoderLayer(cfg)

    def make_rotaries(self, cfg: LlamaConfig) -> list[RotaryEmbedding]:
        """The rotary tables the layers use (a layer's ``self_attn.rope_index`` picks one); Llama: one."""
        return [RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)]

    def reset_rotaries(self, device: str | torch.device) -> None:
        """Recompute every rotary's ``inv_freq`` on ``device`` (those of a model built on ``meta``)."""
        for r in self.rotaries:
            r.inv_freq = r.compute_inv_freq().to(device)
            r._cos = r._sin = r._cos_sin = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] int64 -> [T, hidden] in the model dtype. Tensor-parallel: this rank's vocab rows, zeros for
        the other ranks' tokens, summed over the ranks (one non-zero term per element: exact)."""
        if self.tp is None:
            return F.embedding(input_ids, self.embed_tokens.weight)
        w = self.embed_tokens.weight
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= w.shape[0])
        x = F.embedding(local.clamp(0, w.shape[0] - 1), w).float()
        x[outside] = 0
        return self.tp.all_reduce_float32(x).to(w.dtype)

    def remap_weight(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """A checkpoint tensor as the HF Llama names :func:`tinyvllm.model.weights.load_weights` maps
        (``model.layers.N.self_attn.q_proj.weight`` ...); a family rewrites its own names or values here."""
        yield name, tensor

    @property
    def packed(self) -> bool:
        """Whether the linear weights are packed for the C++ GEMM (:meth:`pack_for_cpu`)."""
        return self.lm_head_packed is not None or any(isinstance(m, Linear) and m.packed is not None
                                                      for m in self.modules())

    def bind_attn_backend(self, backend: AttentionBackend) -> None:
        """Run every later :meth:`forward` with ``backend``'s ops (chosen once, e.g. by
        :func:`tinyvllm.attention.selector.get_attn_backend`). The C++ backend packs the linear
        weights for its GEMM (:meth:`pack_for_cpu`; once: binding again, as engines sharing one
        model do, changes nothing).

        Raises:
            ValueError: the weights are packed for the C++ GEMM but ``backend`` does not run it; or a
                backend of another kind is already bound (engines sharing one model share its backend).
        """
        if self.attn_backend is not None and type(self.attn_backend) is not type(backend):
            raise ValueError(f"this model already runs the {self.attn_backend.name!r} attention backend; engines "
                             f"sharing it cannot use {backend.name!r} (load the model again)")
        if backend.cpu_gemm is not None:
            self.pack_for_cpu(backend.cpu_gemm)
        elif self.packed:
            raise ValueError(f"the weights are packed for the C++ GEMM; the {backend.name!r} attention backend "
                             "cannot run them (load the model again)")
        for mod in self.modules():
            if mod is not self and hasattr(mod, "bind") and callable(mod.bind):
                mod.bind(backend)
        self._plan = self.make_plan()
        self.attn_backend = backend

    def make_plan(self) -> list[tuple]:
        """Per layer, the tensors and bound calls :meth:`forward` reads (no module dispatch on the hot path)."""
        return [(layer.input_layernorm.weight, layer.input_layernorm.eps, layer.self_attn.forward_paged,
                 layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, layer.mlp.forward_paged)
                for layer in self.layers]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                md: Any) -> torch.Tensor:
        """Run the decoder over a packed batch.

        One loop over the layers' tensors, calling the bound backend's ops and the linear layers'
        ``forward`` directly (no ``nn.Module`` dispatch on the hot path).

        Args:
            input_ids: [T] int64 new tokens of all sequences, packed.
            positions: [T] int64 position of each token in its sequence.
            kv_caches: per layer, [2, num_blocks, block_size, Hk, D] in the model dtype.
            md: this step's metadata, built by the bound backend's ``build_metadata``.
        Returns:
            [T, hidden] final hidden states (after the last RMSNorm).
        """
        be = self.attn_backend
        if be is None:
            raise RuntimeError("no attention backend bound: call bind_attn_backend(get_attn_backend(device, dtype))")
        norm = be.rms_norm
        ropes = [be.rope_inputs(r, positions) for r in self.rotaries]
        x = self.embed(input_ids)
        residual = None
        for (ln1, eps1, attn, ln2, eps2, mlp), kv in zip(self._plan, kv_caches):
            h, residual = norm(x, residual, ln1, eps1)
            h, residual = norm(attn(h, kv, md, ropes), residual, ln2, eps2)
            x = mlp(h)
        return norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def pack_for_cpu(self, kern: Any) -> bool:
        """Pack every linear weight (and the tied LM head) for the batch-invariant bf16 GEMM of
        ``cpu_gemm.cpp`` (``kern``: the C++ kernels module, built for AVX512-BF16). Only for bfloat16
        weights on the CPU. The unpacked layer weights are freed (the embedding table stays for token
        lookup; a tied head therefore costs vocab x hidden x 2 bytes more), so ``state_dict()`` shows
        empty layer weights and :func:`tinyvllm.model.weights.load_weights` refuses to run afterwards.

        Returns:
            whether the weights were packed (False: not bf16 on the CPU, or already packed).
        """
        w = self.embed_tokens.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or self.lm_head_packed is not None:
            return False
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.packed is None and mod.quant is None:
                mod.pack(kern)
        if self.lm_head is None and self.lm_head_quant is None:
            self.lm_head_packed = kern.gemm_pack_bf16(w.data.contiguous())
        self._kern = kern
        return True

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits.

        With the C++ kernels (packed bf16 weights, or native GGUF blocks) the logits are the GEMM's
        float32 sums, never rounded to bf16: a bf16 logit is off by up to 2^-9 of its size (0.03 nats at
        16), which decides near-ties between tokens; the mean error of float32's own tokens' logprobs
        fell from 0.021 to 0.017 nats on the 24 chat prompts of benchmarks/bf16_fidelity.py (issue 37).
        The ``F.linear`` fallback rounds to the model dtype first. Tensor-parallel: each rank's logits of
        its vocab rows, all-gathered (a copy: exact) so every rank holds [N, vocab]."""
        logits = self._local_logits(hidden)
        if self.tp is None:
            return logits
        per = self.vocab_per_rank
        if logits.shape[1] < per:
            logits = torch.cat([logits, logits.new_zeros(logits.shape[0], per - logits.shape[1])], dim=1)
        return self.tp.all_gather_last(logits)[:, :self.config.vocab_size]

    def _local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, rows of this rank's LM head] float32 (:meth:`compute_logits`)."""
        if self.lm_head is not None:
            return self.lm_head.forward_float32(hidden)
        if self.lm_head_quant is not None:
            return self.lm_head_quant.run(self.lm_head_quant_kern, hidden, None, True)
        if self.lm_head_packed is not None:
            cfg = self.config
            return self._kern.gemm_bf16(hidden, self.lm_head_packed, self.embed_tokens.weight.shape[0],
                                        cfg.hidden_size, None, True)
        return batch_invariant_linear(hidden, self.embed_tokens.weight).float()
