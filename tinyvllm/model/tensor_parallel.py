"""Tensor parallelism applied to a loaded model from outside (as gpt-fast's ``tp.py``; the layer split of
Megatron-LM, Shoeybi et al. 2019, section 3, and vLLM's ``model_executor/layers/linear.py`` /
``vocab_parallel_embedding.py``).

:func:`shard_model` keeps this rank's share of every weight of a model that :func:`tinyvllm.model.weights.load_model`
loaded whole, before the model runner packs the weights for the GEMM:

- **column-parallel** (output rows split, no communication): ``qkv_proj`` split by heads (each rank keeps
  whole KV heads and the query heads of their GQA groups; with fewer KV heads than ranks a KV head is
  replicated on ``tp / num_kv_heads`` ranks that split its query heads), ``gate_up_proj`` split along the
  intermediate dim (gate and up alike), every MoE expert's ``gate_up_proj`` the same way;
- **row-parallel** (input columns split, then an all-reduce of the float32 partial sums): ``o_proj``,
  ``down_proj``; a MoE block all-reduces its summed experts once; a row-parallel bias is added once,
  after the sum;
- **vocab-parallel** embedding (each rank holds ``ceil(V / tp)`` rows; a token's row comes from its owner,
  zeros elsewhere, summed: exact) and LM head (each rank's logits for its vocab rows, all-gathered: exact).

Norms, rotary tables and MoE routers stay whole on every rank. Each rank's config reports its own head
counts, so the model runner allocates only this rank's KV heads (``num_kv_heads / tp`` of the cache).

Shares need not be equal: 9 query / 3 KV heads (SmolLM2-135M) over 2 ranks are 6 + 3 query heads (2 + 1 KV
heads). Refused, in one line (:class:`TensorParallelError`): more ranks than query heads; more ranks than
KV heads when the ranks are not a multiple of them or a GQA group does not split evenly; native GGUF blocks
whose split does not fall on a quant block (or 16-row group) boundary; an MoE with experts narrower than
the ranks.

Memory: every rank loads the whole checkpoint before keeping its share (peak = the full model per rank);
a loader that reads only each rank's slices is future work (docs/parallelism.md).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from tinyvllm.distributed.parallel_state import TPGroup, split_sizes
from tinyvllm.model.layers import Attention, GatedMLP, Linear


class TensorParallelError(ValueError):
    """A model that cannot be split over the requested ranks (the message names why)."""


def head_partition(num_heads: int, num_kv_heads: int, tp: int) -> list[tuple[int, int, int, int]]:
    """Per rank ``(q_start, q_count, kv_start, kv_count)`` in heads.

    Raises:
        TensorParallelError: the heads cannot be split over ``tp`` ranks (see the module docstring).
    """
    if tp > num_heads:
        raise TensorParallelError(f"tensor_parallel_size {tp} exceeds the model's {num_heads} attention heads")
    if num_heads % num_kv_heads:
        raise TensorParallelError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    g = num_heads // num_kv_heads
    if tp <= num_kv_heads:
        out, kv = [], 0
        for n in split_sizes(num_kv_heads, tp):
            out.append((kv * g, n * g, kv, n))
            kv += n
        return out
    rep = tp // num_kv_heads
    if tp % num_kv_heads or g % rep:
        raise TensorParallelError(
            f"tensor_parallel_size {tp} does not divide the heads: {num_kv_heads} KV heads x {g} query heads each "
            f"can be split over a divisor of {num_kv_heads} ranks, or replicated over a multiple of {num_kv_heads} "
            f"ranks that divides {num_heads}")
    per = g // rep
    return [(r // rep * g + r % rep * per, per, r // rep, 1) for r in range(tp)]


def check_tensor_parallel(config: Any, tp: int) -> None:
    """Refuse, before any process starts, a ``tp`` the model config (an HF ``config.json`` dict or a
    parsed family config) cannot be split over.

    Raises:
        TensorParallelError: the reason, in one line.
    """
    get = config.get if isinstance(config, dict) else lambda k, d=None: getattr(config, k, d)
    heads = int(get("num_attention_heads"))
    kv = int(get("num_key_value_heads") or heads)
    head_partition(heads, kv, tp)
    experts = int(get("num_experts", 0) or 0)
    inter = int(get("moe_intermediate_size", 0) or 0)
    if experts and inter < tp:
        raise TensorParallelError(f"tensor_parallel_size {tp} exceeds the MoE experts' intermediate size {inter}")
    if int(get("intermediate_size")) < tp:
        raise TensorParallelError(f"tensor_parallel_size {tp} exceeds the MLP's intermediate size")


# ----------------------------------------------------------------------------- weights


def _quant_rows(w: Any, ranges: list[tuple[int, int]], name: str) -> Any:
    """The rows ``ranges`` ``[(start, count)]`` of a GGUF :class:`~tinyvllm.model.gguf_quant.QuantWeight` or
    ``QuantParts`` (16-row groups: each range must start on a group and end on one or at the last row)."""
    from tinyvllm.model.gguf_quant import QuantParts, QuantWeight, _fuse

    parts = w.parts if isinstance(w, QuantParts) else [w]
    out, base = [], 0
    for p in parts:
        for s, c in ranges:
            lo, hi = max(s, base), min(s + c, base + p.n)
            if lo >= hi:
                continue
            a, b = lo - base, hi - base
            if a % 16 or (b % 16 and b != p.n):
                raise TensorParallelError(f"GGUF weight {name}: rows {a}..{b} of {p.n} do not fall on 16-row groups; "
                                          "run this model with --quantization none for tensor parallelism")
            g0, g1 = a // 16, -(-b // 16)
            out.append(QuantWeight(p.qs[g0:g1].contiguous(), p.scales[g0:g1].contiguous(), p.fmt, b - a, p.k, p.qtype))
        base += p.n
    return _fuse(out) if len(out) > 1 else out[0]


def _quant_cols(w: Any, start: int, count: int, name: str) -> Any:
    """Input columns ``start .. start + count`` of a GGUF weight: whole quant blocks (32 values; K-quant
    scales per 256), else :class:`TensorParallelError`."""
    from tinyvllm.model.gguf_quant import QuantParts, QuantWeight

    if isinstance(w, QuantParts):
        return QuantParts([_quant_cols(p, start, count, name) for p in w.parts])
    unit_q, unit_s = w.k // w.qs.shape[1], w.k // w.scales.shape[1]
    unit = max(unit_q, unit_s)
    if start % unit or count % unit:
        raise TensorParallelError(f"GGUF weight {name} ({w.qtype}): the split at columns {start}..{start + count} "
                                  f"of {w.k} is not on a {unit}-value quant block; run with --quantization none")
    qs = w.qs[:, start // unit_q:(start + count) // unit_q].contiguous()
    sc = w.scales[:, start // unit_s:(start + count) // unit_s].contiguous()
    return QuantWeight(qs, sc, w.fmt, w.n, count, w.qtype)


def shard_rows(lin: Linear, ranges: list[tuple[int, int]], name: str = "?") -> None:
    """Keep the output rows ``ranges`` of ``lin`` (weight and bias), concatenated in order (column-parallel)."""
    with torch.no_grad():
        if lin.quant is not None:
            lin.quant = _quant_rows(lin.quant, ranges, name)
        else:
            lin.weight = nn.Parameter(torch.cat([lin.weight[s:s + c] for s, c in ranges]).contiguous(),
                                      requires_grad=False)
        if lin.bias is not None:
            lin.bias = nn.Parameter(torch.cat([lin.bias[s:s + c] for s, c in ranges]).contiguous(), requires_grad=False)
    lin.out_features = sum(c for _, c in ranges)


def shard_cols(lin: Linear, start: int, count: int, tp: TPGroup | None, name: str = "?") -> None:
    """Keep the input columns ``start .. start + count`` of ``lin`` (row-parallel); with ``tp`` its forward
    all-reduces the partial sums (and adds the bias once, after)."""
    with torch.no_grad():
        if lin.quant is not None:
            lin.quant = _quant_cols(lin.quant, start, count, name)
        else:
            lin.weight = nn.Parameter(lin.weight[:, start:start + count].contiguous(), requires_grad=False)
    lin.in_features = count
    lin.tp_group = tp


def _unit(lin: Linear) -> int:
    """The input-column granularity a row-parallel split of ``lin`` must keep (1, or a quant block)."""
    w = lin.quant
    if w is None:
        return 1
    parts = getattr(w, "parts", [w])
    return max(max(p.k // p.qs.shape[1], p.k // p.scales.shape[1]) for p in parts)


def _split_mlp(mlp: GatedMLP, rank: int, world: int, tp: TPGroup | None, name: str) -> None:
    """Split one gated MLP's intermediate dim: ``gate_up_proj`` rows (gate and up), ``down_proj`` columns."""
    inter = mlp.inter
    unit = max(_unit(mlp.down_proj), 16 if mlp.gate_up_proj.quant is not None else 1)
    if inter % unit:
        raise TensorParallelError(f"{name}: intermediate size {inter} is not a multiple of its {unit}-value blocks")
    sizes = [n * unit for n in split_sizes(inter // unit, world)]
    if min(sizes) == 0:
        raise TensorParallelError(f"{name}: intermediate size {inter} in {unit}-value blocks leaves a rank empty "
                                  f"at tensor_parallel_size {world}")
    start, count = sum(sizes[:rank]), sizes[rank]
    shard_rows(mlp.gate_up_proj, [(start, count), (inter + start, count)], f"{name}.gate_up_proj")
    shard_cols(mlp.down_proj, start, count, tp, f"{name}.down_proj")
    mlp.inter = count


def shard_model(model: Any, tp: TPGroup) -> None:
    """Keep rank ``tp.rank``'s share of every weight of ``model`` (a :class:`~tinyvllm.model.llama.LlamaForCausalLM`
    or family subclass, loaded whole, not yet packed) and wire its row-parallel layers to ``tp``'s all-reduce.
    ``model.config`` becomes this rank's copy with its own head counts (the KV cache's shape).

    Raises:
        TensorParallelError: the model cannot be split over ``tp.world_size`` ranks.
        RuntimeError: the weights are already packed for the GEMM.
    """
    from tinyvllm.model.qwen3_moe import SparseMoeBlock

    if model.packed:
        raise RuntimeError("shard_model must run before the weights are packed (before the model runner)")
    cfg, r, n = model.config, tp.rank, tp.world_size
    check_tensor_parallel(cfg, n)
    q0, qn, k0, kn = head_partition(cfg.num_attention_heads, cfg.num_key_value_heads, n)[r]
    for i, layer in enumerate(model.layers):
        attn: Attention = layer.self_attn
        d = attn.head_dim
        q, kv = attn.num_heads * d, attn.num_kv_heads * d
        shard_rows(attn.qkv_proj, [(q0 * d, qn * d), (q + k0 * d, kn * d), (q + kv + k0 * d, kn * d)],
                   f"layers.{i}.qkv_proj")
        shard_cols(attn.o_proj, q0 * d, qn * d, tp, f"layers.{i}.o_proj")
        attn.num_heads, attn.num_kv_heads, attn.q_size, attn.kv_size = qn, kn, qn * d, kn * d
        mlp = layer.mlp
        if isinstance(mlp, SparseMoeBlock):
            for e, expert in enumerate(mlp.experts):
                _split_mlp(expert, r, n, None, f"layers.{i}.mlp.experts.{e}")
            mlp.tp_group = tp
        else:
            _split_mlp(mlp, r, n, tp, f"layers.{i}.mlp")
    # vocab-parallel embedding and LM head: rank r holds rows [r * per, min(V, (r + 1) * per))
    vocab = cfg.vocab_size
    per = -(-vocab // n)
    per = -(-per // 16) * 16  # whole 16-row groups (native GGUF LM heads)
    v0, vn = min(vocab, r * per), max(0, min(vocab, (r + 1) * per) - r * per)
    if vn == 0:
        raise TensorParallelError(f"vocabulary of {vocab} tokens leaves rank {r} of {n} no rows")
    with torch.no_grad():
        model.embed_tokens.weight = nn.Parameter(model.embed_tokens.weight[v0:v0 + vn].contiguous(),
                                                 requires_grad=False)
    model.embed_tokens.num_embeddings = vn
    if model.lm_head is not None:
        shard_rows(model.lm_head, [(v0, vn)], "lm_head")
    if model.lm_head_quant is not None:
        model.lm_head_quant = _quant_rows(model.lm_head_quant, [(v0, vn)], "lm_head")
    model.tp, model.vocab_start, model.vocab_per_rank = tp, v0, per
    model.config = dataclasses.replace(cfg, num_attention_heads=qn, num_key_value_heads=kn)
