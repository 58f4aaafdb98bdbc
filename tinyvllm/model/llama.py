"""Llama architecture (Touvron et al. 2023) over a packed batch with a paged KV cache.

All sequences' new tokens are flattened into one ``[num_tokens]`` tensor with
their ``positions``; there is no padding. The model holds the weights and runs
one loop over its layers; the per-layer ops (RMSNorm + residual, RoPE + KV-cache
write + paged attention, the SwiGLU activation) are those of the attention
backend bound once with :meth:`LlamaForCausalLM.bind_attn_backend`
(:mod:`tinyvllm.attention`). Weight loading is in :mod:`tinyvllm.model.weights`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention.base import AttentionBackend
from tinyvllm.model.layers import RMSNorm, RotaryEmbedding


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

        Raises:
            ValueError: not a Llama-architecture config.
        """
        arch = d.get("model_type", "llama")
        if arch not in ("llama", "mistral", "qwen2") and "LlamaForCausalLM" not in d.get("architectures", []):
            raise ValueError(f"unsupported model_type {arch!r}: tinyvllm runs Llama-architecture models")
        heads = int(d["num_attention_heads"])
        rope_params = d.get("rope_parameters") or {}
        rope_theta = float(d.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        rope_scaling = d.get("rope_scaling")
        if rope_scaling is None and rope_params.get("rope_type", "default") != "default":
            rope_scaling = dict(rope_params)
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
        )

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> "LlamaConfig":
        return cls.from_dict(json.loads((Path(model_dir) / "config.json").read_text()))

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        """Bytes of K and V for one token across all layers."""
        elem = torch.empty(0, dtype=dtype).element_size()
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * elem


SLAB_ROWS = 16
"""Rows per ``F.linear`` call in :func:`batch_invariant_linear`."""


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row results do not depend on how many rows are in the batch.

    ``x``: [M, in]; ``weight``: [out, in]; returns [M, out] in ``x``'s dtype.

    On the CPU the library GEMMs (oneDNN for bf16, MKL for fp32) pick their kernel by the shape, so a
    row's result depends on M. Measured with torch 2.13 on an Intel Xeon with AMX: bf16 rows differ
    between M = 5, 16, 32, 90 and 300 for every projection shape of SmolLM2, fp32 rows differ between
    M = 64 and M = 300 at K = 1536; on an AMD EPYC only M == 1 (bf16) and M < 12 (fp32) differed.
    What held on both: one fixed shape gives the same row whatever the row's position in it. So the
    rows go through ``F.linear`` in slabs of exactly :data:`SLAB_ROWS` rows, the last one padded with
    zero rows (tests/test_backend_exactness.py). This is the fallback path (no C++ build, no
    AVX512-BF16, fp32 models); the packed bf16 GEMM of ``cpu_gemm.cpp`` is batch invariant by
    construction. Other devices keep one ``F.linear`` call, padded to 2 rows.
    """
    m = x.shape[0]
    if x.device.type != "cpu":
        if m >= 2:
            return F.linear(x, weight, bias)
        return F.linear(torch.cat([x, x.new_zeros(2 - m, x.shape[1])]), weight, bias)[:m]
    r = SLAB_ROWS
    pad = (-m) % r
    if pad:
        x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
    if x.shape[0] == r:
        return F.linear(x, weight, bias)[:m]
    return torch.cat([F.linear(x[i:i + r], weight, bias) for i in range(0, x.shape[0], r)])[:m]


class Linear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on the batch.

    On the CPU in bfloat16 with the C++ kernels, :meth:`pack` replaces the weight by the packed
    layout of ``gemm_bf16`` (``cpu_gemm.cpp``: batch invariant by construction, weights streamed
    once per call); otherwise :func:`batch_invariant_linear` (``F.linear`` over fixed-size row slabs).
    """

    packed: torch.Tensor | None = None
    quant: Any = None  # a gguf_quant.QuantWeight (or QuantParts) once quantize() ran (native GGUF blocks)

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:  # see Embedding.reset_parameters
            super().reset_parameters()

    def pack(self, kern: Any) -> None:
        """Pack the [out, in] bf16 weight for ``kern.gemm_bf16`` and free the unpacked copy."""
        self.packed = kern.gemm_pack_bf16(self.weight.data.contiguous())
        self._kern = kern
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def quantize(self, w: Any, kern: Any) -> None:
        """Run on the repacked GGUF blocks ``w`` (:class:`tinyvllm.model.gguf_quant.QuantWeight`, [out, in])
        with ``kern.gemm_gguf`` (``cpu_gemm_gguf.cpp``) and free the dequantized weight."""
        self.quant = w
        self._kern = kern
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self._kern.gemm_bf16(x, self.packed, self.out_features, self.in_features, self.bias)
        if self.quant is not None:
            return self.quant.run(self._kern, x, self.bias)
        return batch_invariant_linear(x, self.weight, self.bias)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with float32 outputs: on packed weights the GEMM's float32 sums as they are
        (``gemm_bf16(..., out_float=True)``: not rounded to bf16 first, see :meth:`LlamaForCausalLM.compute_logits`);
        elsewhere :meth:`forward`'s output converted."""
        if self.packed is not None:
            return self._kern.gemm_bf16(x, self.packed, self.out_features, self.in_features, self.bias, True)
        if self.quant is not None:
            return self.quant.run(self._kern, x, self.bias, True)
        return self.forward(x).float()


class Embedding(nn.Embedding):
    """``nn.Embedding`` that does not initialise a weight on the meta device.

    :func:`~tinyvllm.model.weights.load_model` builds the model on ``meta`` and then assigns or loads
    every tensor; "initialising" a meta tensor (``normal_``, ``uniform_``) runs a Python reference
    implementation that imports ``torch._dynamo`` (1.5 s of every engine start, measured).
    """

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class LlamaAttention(nn.Module):
    """The attention block's weights; the computation is the backend's (:meth:`AttentionBackend.attention`)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.attention_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.attention_bias)
        self.scale = self.head_dim ** -0.5


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020) weights: ``down(silu(gate(x)) * up(x))``, gate and up fused."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)


class LlamaDecoderLayer(nn.Module):
    """A pre-norm block's weights (the loop is :meth:`LlamaForCausalLM.forward`)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head (tied to the embedding or separate).

    Call :meth:`bind_attn_backend` once before :meth:`forward`.
    """

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head_packed: torch.Tensor | None = None  # tied head packed for the CPU GEMM (pack_for_cpu)
        self.lm_head_quant: Any = None  # tied head on its GGUF blocks (gguf_quant.attach_gguf_quant)
        self.quantization = "none"  # "gguf" once gguf_quant.attach_gguf_quant ran
        self._kern: Any = None  # the C++ kernels module, once pack_for_cpu packed the weights
        self.attn_backend: AttentionBackend | None = None
        self._plan: list[tuple] = []  # per layer, the tensors and linear layers forward reads (bind_attn_backend)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

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
        self._plan = [(layer.input_layernorm.weight, layer.input_layernorm.eps, layer.self_attn.qkv_proj,
                       layer.self_attn.o_proj, layer.post_attention_layernorm.weight,
                       layer.post_attention_layernorm.eps, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                      for layer in self.layers]
        self.attn_backend = backend

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
        norm, attention, act = be.rms_norm, be.attention, be.silu_and_mul
        cfg = self.config
        hq, hk, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        scale = d ** -0.5
        rope = be.rope_inputs(self.rotary, positions)
        x = F.embedding(input_ids, self.embed_tokens.weight)
        residual = None
        for (ln1, eps1, qkv_proj, o_proj, ln2, eps2, gate_up_proj, down_proj), kv in zip(self._plan, kv_caches):
            h, residual = norm(x, residual, ln1, eps1)
            o = attention(qkv_proj.forward(h), kv, md, rope, hq, hk, d, scale)
            h, residual = norm(o_proj.forward(o), residual, ln2, eps2)
            x = down_proj.forward(act(gate_up_proj.forward(h)))
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
        The ``F.linear`` fallback rounds to the model dtype first."""
        if self.lm_head is not None:
            return self.lm_head.forward_float32(hidden)
        if self.lm_head_quant is not None:
            return self.lm_head_quant.run(self.lm_head_quant_kern, hidden, None, True)
        if self.lm_head_packed is not None:
            cfg = self.config
            return self._kern.gemm_bf16(hidden, self.lm_head_packed, cfg.vocab_size, cfg.hidden_size, None, True)
        return batch_invariant_linear(hidden, self.embed_tokens.weight).float()
