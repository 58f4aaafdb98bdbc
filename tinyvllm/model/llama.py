"""Llama architecture (Touvron et al. 2023) over a packed batch with a paged KV cache.

All sequences' new tokens are flattened into one ``[num_tokens]`` tensor with
their ``positions``; there is no padding. Attention writes new keys/values into
the paged cache through the slot mapping and reads each sequence's context
through its block table (:mod:`tinyvllm.attention.backend`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tinyvllm.attention.backend import AttentionMetadata, paged_attention
from tinyvllm.config import LOAD_FORMATS
from tinyvllm.model.layers import RMSNorm, RotaryEmbedding, apply_rotary, rope_inv_freq


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


def min_rows_for(dtype: torch.dtype) -> int:
    """Smallest row count M for which CPU GEMM rows do not depend on M (measured, torch 2.13 + oneDNN/MKL):
    bf16 gives a different result at M == 1 than at M >= 2 for some shapes (e.g. K = 1536); fp32 (MKL)
    differs for M < 12. Padding small batches to this many rows keeps greedy outputs batch invariant."""
    return 16 if dtype == torch.float32 else 2


def batch_invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose row results do not depend on how many rows are in the batch.

    ``x``: [M, in]; ``weight``: [out, in]. Pads M up to :func:`min_rows_for` with zero rows.
    """
    m = x.shape[0]
    need = min_rows_for(x.dtype)
    if m >= need:
        return F.linear(x, weight, bias)
    pad = torch.zeros(need - m, x.shape[1], dtype=x.dtype, device=x.device)
    return F.linear(torch.cat([x, pad]), weight, bias)[:m]


class Linear(nn.Linear):
    """``nn.Linear`` whose rows do not depend on the batch.

    On the CPU in bfloat16 with the C++ kernels, :meth:`pack` replaces the weight by the packed
    layout of ``gemm_bf16`` (``cpu_gemm.cpp``: batch invariant by construction, weights streamed
    once per call); otherwise :func:`batch_invariant_linear` (``F.linear`` with padded rows).
    """

    packed: torch.Tensor | None = None

    def pack(self, kern: Any) -> None:
        """Pack the [out, in] bf16 weight for ``kern.gemm_bf16`` and free the unpacked copy."""
        self.packed = kern.gemm_pack_bf16(self.weight.data.contiguous())
        self._kern = kern
        self.weight.data = torch.empty(0, dtype=self.weight.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return self._kern.gemm_bf16(x, self.packed, self.out_features, self.in_features, self.bias)
        return batch_invariant_linear(x, self.weight, self.bias)


class RopeInputs:
    """Per-step rotary inputs shared by all layers: positions [T] int64 and the cos/sin tables."""

    def __init__(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> None:
        from tinyvllm.attention.backend import cpu_kernel, use_triton

        self.positions = positions
        self.rotary = rotary
        # On CUDA avoid a host read-back (CUDA-graph capture): the tables cover max_position anyway.
        needed = rotary.max_position if positions.is_cuda else (int(positions.max().item()) + 1 if positions.numel() else 1)
        self.cos_table, self.sin_table = rotary.tables(needed)
        # GPU path: the fused Triton rotary kernel, in place on q and k, reading this [n, D] table.
        self.cos_sin_cache = rotary.cos_sin_cache(needed) if use_triton(positions.device) else None
        self.kernel = cpu_kernel() if positions.device.type == "cpu" and self.cos_sin_cache is None else None
        self._gathered: tuple[torch.Tensor, torch.Tensor] | None = None

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin at each token's position: [T, 1, D/2] float32 each."""
        if self._gathered is None:
            self._gathered = (self.cos_table[self.positions].unsqueeze(1), self.sin_table[self.positions].unsqueeze(1))
        return self._gathered


class LlamaAttention(nn.Module):
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

    def forward(self, rope: "RopeInputs", x: torch.Tensor, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> torch.Tensor:
        # (On the CPU with the C++ kernels, LlamaForCausalLM._forward_cpu runs instead of this.)
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        if rope.cos_sin_cache is not None:  # GPU: rotate q and k in place inside the fused qkv output
            from tinyvllm.attention import triton_ops

            qkv = qkv.view(T, self.num_heads + 2 * self.num_kv_heads, self.head_dim)
            q, k = qkv[:, : self.num_heads], qkv[:, self.num_heads: self.num_heads + self.num_kv_heads]
            v = qkv[:, self.num_heads + self.num_kv_heads:]
            triton_ops.rotary_embedding(rope.positions, q, k, rope.cos_sin_cache)
            o = paged_attention(q, k, v, kv_cache, md, self.scale)
            return self.o_proj(o.reshape(T, self.q_size))
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(T, self.num_heads, self.head_dim)
        k = k.reshape(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        cos, sin = rope.gathered()
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        o = paged_attention(q, k, v, kv_cache, md, self.scale)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaMLP(nn.Module):
    """SwiGLU feed-forward (Shazeer 2020): ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        from tinyvllm.attention.backend import cpu_kernel

        kern = cpu_kernel() if gu.device.type == "cpu" and gu.dtype in (torch.bfloat16, torch.float32) else None
        if kern is not None:
            return self.down_proj(kern.silu_and_mul(gu))
        gate, up = gu.split([self.inter, self.inter], dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg)

    def forward(self, rope: "RopeInputs", x: torch.Tensor, residual: torch.Tensor | None, kv_cache: torch.Tensor,
                md: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual stream carried separately: returns (mlp output, residual)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, kv_cache, md)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Llama decoder with an LM head (tied to the embedding or separate)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling)
        self.lm_head_packed: torch.Tensor | None = None  # tied head packed for the CPU GEMM (pack_for_cpu)
        self._kern: Any = None  # the C++ kernels module, once pack_for_cpu packed the weights
        self._plan: list[tuple] | None = None  # per-layer modules/tensors of _forward_cpu, built on first use
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                md: AttentionMetadata) -> torch.Tensor:
        """Run the decoder over a packed batch.

        Args:
            input_ids: [T] int64 new tokens of all sequences, packed.
            positions: [T] int64 position of each token in its sequence.
            kv_caches: per layer, [2, num_blocks, block_size, Hk, D] in the model dtype.
            md: attention metadata for this step.
        Returns:
            [T, hidden] final hidden states (after the last RMSNorm).
        """
        rope = RopeInputs(self.rotary, positions)
        if rope.kernel is not None and md.token_seq is not None and input_ids.device.type == "cpu" \
                and self.embed_tokens.weight.dtype in (torch.bfloat16, torch.float32):
            return self._forward_cpu(rope, input_ids, kv_caches, md)
        x = self.embed_tokens(input_ids)
        residual = None
        for layer, kv in zip(self.layers, kv_caches):
            x, residual = layer(rope, x, residual, kv, md)
        return self.norm(x, residual)[0]

    def pack_for_cpu(self) -> bool:
        """Pack every linear weight (and the tied LM head) for the batch-invariant bf16 GEMM of
        ``cpu_gemm.cpp``. Only for bfloat16 weights on the CPU, with the C++ kernels built for
        AVX512-BF16. The unpacked layer weights are freed (the embedding table stays for token
        lookup; a tied head therefore costs vocab x hidden x 2 bytes more), so ``state_dict()``
        shows empty layer weights and :meth:`load_weights` refuses to run afterwards.

        Returns:
            whether the weights were packed.
        """
        w = self.embed_tokens.weight
        if w.device.type != "cpu" or w.dtype != torch.bfloat16 or self.lm_head_packed is not None:
            return False
        from tinyvllm.attention.backend import cpu_kernel

        kern = cpu_kernel()
        if kern is None or not kern.gemm_has_bf16_kernel():  # the portable GEMM loop is far slower than oneDNN
            return False
        for mod in self.modules():
            if isinstance(mod, Linear) and mod.packed is None:
                mod.pack(kern)
        if self.lm_head is None:
            self.lm_head_packed = kern.gemm_pack_bf16(w.data.contiguous())
        self._kern = kern
        return True

    def _cpu_plan(self) -> list[tuple]:
        """Per layer, the modules and norm weights the fused C++ path needs (built once; nothing copied)."""
        if self._plan is None:
            plan = []
            for layer in self.layers:
                a, m = layer.self_attn, layer.mlp
                plan.append((layer.input_layernorm.weight, layer.input_layernorm.eps, a.qkv_proj, a.o_proj,
                             layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps,
                             m.gate_up_proj, m.down_proj))
            self._plan = plan
        return self._plan

    def _forward_cpu(self, rope: RopeInputs, input_ids: torch.Tensor, kv_caches: list[torch.Tensor],
                     md: AttentionMetadata) -> torch.Tensor:
        """The same computation as the module path (same kernels, same order), as one flat loop over
        the layers' tensors: no ``nn.Module`` dispatch, ~10 calls per layer."""
        kern = rope.kernel
        cfg = self.config
        hq, hk, scale = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim ** -0.5
        x = F.embedding(input_ids, self.embed_tokens.weight)
        residual = None
        cos, sin, pos = rope.cos_table, rope.sin_table, rope.positions
        for (ln1, eps1, qkv_proj, o_proj, ln2, eps2, gate_up_proj, down_proj), kv in zip(self._cpu_plan(), kv_caches):
            h, residual = kern.rms_norm(x, residual, ln1, eps1)
            o = kern.rope_cache_attention(qkv_proj.forward(h), cos, sin, pos, kv, md.slot_mapping, md.block_tables,
                                          md.token_seq, hq, hk, scale)
            h, residual = kern.rms_norm(o_proj.forward(o), residual, ln2, eps2)
            x = down_proj.forward(kern.silu_and_mul(gate_up_proj.forward(h)))
        return kern.rms_norm(x, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> [N, vocab] float32 logits."""
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.lm_head_packed is not None:
            cfg = self.config
            return self._kern.gemm_bf16(hidden, self.lm_head_packed, cfg.vocab_size, cfg.hidden_size, None).float()
        return batch_invariant_linear(hidden, self.embed_tokens.weight).float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) into this module.

        Q/K/V are packed into ``qkv_proj`` and gate/up into ``gate_up_proj``.

        Raises:
            ValueError: an unexpected tensor name or shape, or missing tensors.
            RuntimeError: the weights were already packed by :meth:`pack_for_cpu`.
        """
        if self.lm_head_packed is not None or any(isinstance(m, Linear) and m.packed is not None
                                                   for m in self.modules()):
            raise RuntimeError("weights are packed for the CPU GEMM (pack_for_cpu); build a new model to load weights")
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        cfg = self.config
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
            if n == "lm_head.weight" and self.lm_head is None:
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
        model.load_weights(weights())
    model.eval()
    model.pack_for_cpu()
    return model
