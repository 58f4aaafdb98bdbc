"""Qwen3-MoE (Qwen team 2025; Qwen3-30B-A3B, 235B-A22B): Qwen3's attention with mixture-of-experts MLPs.

What differs from Qwen3: in each sparse layer (``(i + 1) % decoder_sparse_step == 0`` and ``i`` not in
``mlp_only_layers``) the MLP is a router plus ``num_experts`` SwiGLU experts of width
``moe_intermediate_size`` (:class:`SparseMoeBlock`). The router (``mlp.gate``, [E, hidden]) gives each
token softmax probabilities (float32) over the experts; the top ``num_experts_per_tok`` are kept and,
with ``norm_topk_prob``, renormalised to sum to 1 (HF ``Qwen3MoeTopKRouter``; vLLM ``qwen3_moe.py``).
No shared expert (that is Qwen2-MoE).

The experts run grouped: the (token, expert) pairs are sorted by expert, and each expert that any token
chose runs once on all its tokens' rows, so each expert's weights stream once per step (the shape of
vLLM's fused MoE; on the CPU the packed bf16 GEMM or the batch-invariant ``F.linear`` slabs). A token's
outputs are summed in ascending expert order, as transformers does, whatever else is in the batch.
Checkpoint names: per expert (``mlp.experts.E.gate_proj.weight``, released checkpoints) or the fused 3D
``mlp.experts.gate_up_proj`` / ``down_proj`` of transformers 5. GGUF: llama.cpp's ``qwen3moe``
(``ffn_gate_inp``, ``ffn_{gate,up,down}_exps``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
from torch import nn

from tinyvllm.model.layers import GatedMLP, Linear
from tinyvllm.model.llama import LlamaAttention, LlamaConfig, LlamaDecoderLayer, LlamaForCausalLM


@dataclass
class Qwen3MoeConfig(LlamaConfig):
    num_experts: int = 0
    num_experts_per_tok: int = 1
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)

    @classmethod
    def extra_fields(cls, d: dict[str, Any]) -> dict[str, Any]:
        e = int(d.get("num_experts", d.get("num_local_experts", 0)) or 0)
        k = int(d.get("num_experts_per_tok", 1))
        if e and not 1 <= k <= e:
            raise ValueError(f"Qwen3-MoE config: num_experts_per_tok {k} not in 1..num_experts {e}")
        return {"num_experts": e, "num_experts_per_tok": k,
                "moe_intermediate_size": int(d.get("moe_intermediate_size", 0)),
                "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
                "decoder_sparse_step": int(d.get("decoder_sparse_step", 1) or 1),
                "mlp_only_layers": list(d.get("mlp_only_layers") or [])}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Qwen3MoeConfig":
        cfg = super().from_dict(d)
        if d.get("use_sliding_window"):
            cfg.cap_to_sliding_window(d.get("sliding_window"), "Qwen3-MoE")
        return cfg

    def is_sparse(self, index: int) -> bool:
        return (self.num_experts > 0 and index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)


class SparseMoeBlock(nn.Module):
    """Router + experts. ``gate``: Linear [hidden -> E]; ``experts``: E :class:`GatedMLP` (SwiGLU)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, norm_topk_prob: bool) -> None:
        super().__init__()
        self.top_k, self.norm_topk_prob, self.num_experts = top_k, norm_topk_prob, num_experts
        self.gate = Linear(hidden, num_experts, bias=False)
        self.experts = nn.ModuleList(GatedMLP(hidden, inter) for _ in range(num_experts))

    def route(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``h`` [T, hidden] -> (weights [T, k] in ``h``'s dtype, expert ids [T, k] int64): softmax in
        float32 over the router logits, top-k, renormalised with ``norm_topk_prob``."""
        probs = torch.softmax(self.gate.forward(h), dim=-1, dtype=torch.float32)
        w, idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            w = w / w.sum(dim=-1, keepdim=True)
        return w.to(h.dtype), idx

    tp_group: Any = None  # tensor parallelism: each expert holds a slice of its intermediate dim (tensor_parallel.py)

    def forward_paged(self, h: torch.Tensor) -> torch.Tensor:
        """[T, hidden] -> [T, hidden]: each chosen expert runs once on the rows of the tokens that chose it.
        Tensor-parallel: every rank runs every chosen expert on its slice of the expert's intermediate dim;
        the weighted float32 partial sums are all-reduced once per layer."""
        if self.tp_group is not None:
            return self._forward_tp(h)
        w, idx = self.route(h)
        k = self.top_k
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)       # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, slots = order // k, order % k
        out = torch.zeros_like(h)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows, s = tokens[start:start + c], slots[start:start + c]
            start += c
            y = self.experts[e].forward_paged(h.index_select(0, rows)) * w[rows, s].unsqueeze(1)
            out.index_add_(0, rows, y)  # a token appears once per expert: no duplicate rows
        return out

    def _forward_tp(self, h: torch.Tensor) -> torch.Tensor:
        w, idx = self.route(h)
        k = self.top_k
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        tokens, slots = order // k, order % k
        out = torch.zeros(h.shape, dtype=torch.float32, device=h.device)
        start = 0
        for e, c in enumerate(counts):
            if not c:
                continue
            rows, s = tokens[start:start + c], slots[start:start + c]
            start += c
            ex = self.experts[e]
            y = ex.down_proj.partial_float32(ex._act(ex.gate_up_proj.forward(h.index_select(0, rows))))
            out.index_add_(0, rows, y * w[rows, s].unsqueeze(1).float())
        return self.tp_group.all_reduce_float32(out).to(h.dtype)


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    config_class = Qwen3MoeConfig

    def make_layer(self, cfg: Qwen3MoeConfig, index: int) -> nn.Module:
        mlp = (SparseMoeBlock(cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.num_experts_per_tok,
                              cfg.norm_topk_prob) if cfg.is_sparse(index) else None)
        return LlamaDecoderLayer(cfg, attn=LlamaAttention(cfg, qk_norm_eps=cfg.rms_norm_eps), mlp=mlp)

    def remap_weight(self, name: str, tensor: torch.Tensor) -> Iterable[tuple[str, torch.Tensor]]:
        """transformers 5's fused experts ([E, 2I, hidden] gate|up, [E, hidden, I] down) -> per expert."""
        if name.endswith("mlp.experts.gate_up_proj") and tensor.dim() == 3:
            base, inter = name[: -len("gate_up_proj")], tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.gate_proj.weight", tensor[e, :inter]
                yield f"{base}{e}.up_proj.weight", tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj") and tensor.dim() == 3:
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                yield f"{base}{e}.down_proj.weight", tensor[e]
        else:
            yield name, tensor
