"""The building blocks every model family shares (vLLM's ``model_executor/layers``): batch-invariant
linear layers, the embedding, RMSNorm, rotary position embeddings (default, linear and llama3 scaling;
the identity rotation of NoPE layers), the attention block over the paged KV cache (optional QKV bias,
per-head q/k RMSNorm) and the gated MLP (SwiGLU, or GeGLU with tanh GELU).

The per-layer ops are the attention backend's (:mod:`tinyvllm.attention`), bound once with
:meth:`Attention.bind` / :meth:`GatedMLP.bind`; a family file (``llama.py``, ``qwen3.py``, ...) says
which pieces its layers use and how they are wired.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention import torch_ref


class RMSNorm(nn.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32.

    ``y = x / sqrt(mean(x^2) + eps) * weight``, with the same dtype handling as
    Hugging Face's ``LlamaRMSNorm`` (normalise in float32, cast back, then scale).
    Input/output: [..., hidden] in the model dtype.
    """

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Normalise ``x`` [T, H] (the PyTorch reference, :func:`tinyvllm.attention.torch_ref.rms_norm`);
        with ``residual`` [T, H], first ``x = x + residual`` (in the model dtype) and return
        ``(normed, x)`` — the fused residual add of a pre-norm transformer. (The model's forward calls
        its attention backend's ``rms_norm`` with this module's weight and eps instead.)"""
        out, x = torch_ref.rms_norm(x, residual, self.weight, self.eps)
        return out if residual is None else (out, x)


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies ``theta^(-2i/d)`` of RoPE (Su et al. 2021, RoFormer, eq. 15).

    With ``rope_type == "llama3"`` applies Llama 3.1's frequency-dependent scaling
    (Meta's Llama 3.1 reference implementation ``apply_scaling``): wavelengths longer
    than ``original_max_position_embeddings / low_freq_factor`` are divided by
    ``factor``, shorter than ``.../high_freq_factor`` are kept, and the band between
    is interpolated smoothly. ``linear`` scaling divides all frequencies by ``factor``.

    Returns:
        [head_dim // 2] float32.

    Raises:
        ValueError: an unsupported rope type.
    """
    inv_freq = 1.0 / (rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if not rope_scaling:
        return inv_freq
    rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
    if rope_type == "default":
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(rope_scaling["factor"])
    if rope_type == "llama3":
        factor = float(rope_scaling["factor"])
        low = float(rope_scaling.get("low_freq_factor", 1.0))
        high = float(rope_scaling.get("high_freq_factor", 4.0))
        old_len = float(rope_scaling.get("original_max_position_embeddings", 8192))
        low_freq_wavelen = old_len / low
        high_freq_wavelen = old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {rope_type!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half (GPT-NeoX / HF Llama) rotary embedding applied per token by position.

    Holds a cos/sin table [max_positions, head_dim // 2] (float32) built lazily.
    """

    def __init__(self, head_dim: int, max_position: int, rope_theta: float,
                 rope_scaling: dict[str, Any] | None = None, *, identity: bool = False) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope_theta, self.rope_scaling, self.identity = rope_theta, rope_scaling, identity
        # On the CPU even when the model is built on ``meta``: arithmetic on meta tensors runs Python
        # reference implementations that import torch._dynamo (1.5 s). load_model recomputes it anyway.
        with torch.device("cpu"):
            inv_freq = self.compute_inv_freq()
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._cos: torch.Tensor | None = None
        self._sin: torch.Tensor | None = None
        self._cos_sin: torch.Tensor | None = None
        self.max_position = max_position

    def compute_inv_freq(self) -> torch.Tensor:
        """[head_dim // 2] float32 inverse frequencies (:func:`rope_inv_freq`); all zeros for the
        identity rotation (``identity=True``: NoPE layers, cos = 1 and sin = 0 exactly, so the backends'
        rotary leaves q and k bit for bit as they are)."""
        if self.identity:
            return torch.zeros(self.head_dim // 2, dtype=torch.float32)
        return rope_inv_freq(self.head_dim, self.rope_theta, self.rope_scaling)

    def tables(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Full cos and sin tables, each [>= needed, D/2] float32 (built once, grown if needed)."""
        if self._cos is None or self._cos.shape[0] < needed:
            n = max(needed, self.max_position)
            pos = torch.arange(n, dtype=torch.float32, device=self.inv_freq.device)
            freqs = pos[:, None] * self.inv_freq[None, :].float()
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin

    def cos_sin_cache(self, needed: int) -> torch.Tensor:
        """cos and sin side by side, [>= needed, D] float32 (the Triton rotary kernel's table)."""
        cos, sin = self.tables(needed)
        if self._cos_sin is None or self._cos_sin.shape[0] != cos.shape[0]:
            self._cos_sin = torch.cat([cos, sin], dim=-1).contiguous()
        return self._cos_sin


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
    # Row-parallel (tensor parallelism, tinyvllm.model.tensor_parallel): this rank holds a slice of the input
    # columns; forward all-reduces the float32 partial sums over the group, then adds the bias once.
    tp_group: Any = None

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
        if self.tp_group is not None:
            return self.forward_row_parallel(x)
        if self.packed is not None:
            return self._kern.gemm_bf16(x, self.packed, self.out_features, self.in_features, self.bias)
        if self.quant is not None:
            return self.quant.run(self._kern, x, self.bias)
        return batch_invariant_linear(x, self.weight, self.bias)

    def partial_float32(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ weight.T`` without the bias, as float32 sums (the GEMM's own on packed or GGUF weights)."""
        if self.packed is not None:
            return self._kern.gemm_bf16(x, self.packed, self.out_features, self.in_features, None, True)
        if self.quant is not None:
            return self.quant.run(self._kern, x, None, True)
        return batch_invariant_linear(x, self.weight).float()

    def forward_row_parallel(self, x: torch.Tensor) -> torch.Tensor:
        """Row-parallel forward (Megatron-LM's ``RowParallelLinear``; vLLM ``linear.py``): this rank's
        float32 partial sums [M, out], all-reduced over ``tp_group`` (every rank gets the same bits), plus
        the bias, rounded once to ``x``'s dtype."""
        y = self.tp_group.all_reduce_float32(self.partial_float32(x))
        if self.bias is not None:
            y += self.bias
        return y.to(x.dtype)

    def forward_float32(self, x: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` with float32 outputs: on packed weights the GEMM's float32 sums as they are
        (``gemm_bf16(..., out_float=True)``: not rounded to bf16 first, see :meth:`tinyvllm.model.llama.LlamaForCausalLM.compute_logits`);
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


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """GeGLU's activation (Shazeer 2020, "GLU Variants Improve Transformer"; Gemma's
    ``gelu_pytorch_tanh``): ``x`` [T, 2I] = [gate | up] -> ``gelu_tanh(gate) * up`` [T, I], in ``x``'s dtype.
    A torch op: no backend has a fused kernel for it."""
    gate, up = x.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class Attention(nn.Module):
    """Self-attention weights and the per-layer call over the paged KV cache.

    ``qkv_proj`` [hidden -> (Hq + 2 Hk) * D] (fused q, k, v; with ``qkv_bias`` a bias, Qwen2),
    ``o_proj`` [Hq * D -> hidden] (``o_bias``: Llama's ``attention_bias`` biases both). With
    ``qk_norm_eps``, ``q_norm`` / ``k_norm`` are RMSNorms over each head's D features applied before
    RoPE (Qwen3, Gemma 3; vLLM ``qwen3.py``). ``scale``: the softmax scale (default D^-0.5).
    ``rope_index`` picks this layer's rotary among the model's (per-layer rope bases, NoPE layers).
    ``window`` > 0: a sliding-window layer (a query at position p attends to keys p - window + 1 .. p;
    Mistral, Gemma 3's local layers); 0: the whole causal context.
    The RoPE, KV-cache write and paged attention are the bound backend's :meth:`AttentionBackend.attention`.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qkv_bias: bool = False, o_bias: bool = False, scale: float | None = None,
                 qk_norm_eps: float | None = None, rope_index: int = 0, window: int = 0) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.qkv_proj = Linear(hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, hidden_size, bias=o_bias)
        self.scale = head_dim ** -0.5 if scale is None else scale
        self.q_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.k_norm = RMSNorm(head_dim, qk_norm_eps) if qk_norm_eps is not None else None
        self.rope_index = rope_index
        self.window = int(window or 0)
        self._be: Any = None

    def bind(self, backend: Any) -> None:
        self._be = backend

    def forward_paged(self, h: torch.Tensor, kv_cache: torch.Tensor, md: Any, ropes: list[Any]) -> torch.Tensor:
        """``h`` [T, hidden] (normed) -> [T, hidden]: projection, [q/k norm], RoPE + KV write + attention, output
        projection. ``ropes``: the backend's ``rope_inputs`` of each of the model's rotaries."""
        be = self._be
        qkv = self.qkv_proj.forward(h)
        if self.q_norm is not None:
            qkv = self._qk_norm(qkv)
        o = be.attention(qkv, kv_cache, md, ropes[self.rope_index], self.num_heads, self.num_kv_heads,
                         self.head_dim, self.scale, self.window)
        return self.o_proj.forward(o)

    def _qk_norm(self, qkv: torch.Tensor) -> torch.Tensor:
        """Per-head RMSNorm of the q and k parts of ``qkv`` [T, (Hq + 2 Hk) * D] (the backend's
        ``rms_norm`` over [T * H, D] rows); v unchanged."""
        t, d, qs, ks = qkv.shape[0], self.head_dim, self.q_size, self.kv_size
        norm = self._be.rms_norm
        q = norm(qkv[:, :qs].reshape(-1, d).contiguous(), None, self.q_norm.weight, self.q_norm.eps)[0]
        k = norm(qkv[:, qs:qs + ks].reshape(-1, d).contiguous(), None, self.k_norm.weight, self.k_norm.eps)[0]
        return torch.cat([q.reshape(t, qs), k.reshape(t, ks), qkv[:, qs + ks:]], dim=1)


class GatedMLP(nn.Module):
    """Gated feed-forward weights: ``down(act(gate(x)) * up(x))``, gate and up fused in ``gate_up_proj``.

    ``act``: ``silu`` (SwiGLU; the backend's fused ``silu_and_mul``) or ``gelu_tanh`` (GeGLU,
    :func:`gelu_tanh_and_mul`).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, *, bias: bool = False, act: str = "silu") -> None:
        super().__init__()
        if act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported MLP activation {act!r} (supported: silu, gelu_tanh)")
        self.inter = intermediate_size
        self.act = act
        self.gate_up_proj = Linear(hidden_size, 2 * intermediate_size, bias=bias)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias)
        self._act: Any = None

    def bind(self, backend: Any) -> None:
        self._act = backend.silu_and_mul if self.act == "silu" else gelu_tanh_and_mul

    def forward_paged(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]."""
        return self.down_proj.forward(self._act(self.gate_up_proj.forward(h)))
