"""Native GGUF quantized weights (``--quantization gguf``): the linear layers keep their Q8_0 / Q4_0 /
Q4_1 / Q4_K / Q6_K blocks and run on :func:`gemm_gguf` (bf16 activations) or, where the AVX512-VNNI
kernel is built, Q8_0 / Q4_0 / Q4_1 / Q4_K on :func:`gemm_gguf_q8` (activations quantized to int8 per
row and 32-block, llama.cpp's q8_0 / q8_1 scheme; :func:`int8_activations`)
(``tinyvllm/kernels/cpu/cpu_gemm_gguf.cpp``).

At load, each quantized linear tensor of the GGUF file is repacked once (numpy, vectorised) into the
kernel's layout: groups of 16 output columns, per GGUF block of 32 k the integers in the VDPBF16PS
pair order and the scales split out (fp16; the K-quants: their 6/8-bit sub-block scales and fp32
super-block scales) (layout: the kernel's header comment). The repack is exact:
:func:`dequantize_packed` gives back the very float32 values ``gguf.quants.dequantize`` gives.

What stays dequantized (bf16): the token embedding table for the lookup (only the rows a step reads
are touched, through the mapped prepared-weights file); norms. The tied LM head runs natively from the
embedding's blocks (the embedded SmolLM2: Q8_0).

GGML block formats (llama.cpp ``ggml-common.h``; gguf-py ``gguf/quants.py``), 32 weights per block:

* Q8_0: ``d`` fp16, ``qs`` 32 x int8; ``w = d * q``.
* Q4_0: ``d`` fp16, ``qs`` 16 bytes; ``q`` = low nibbles (elements 0..15) then high nibbles
  (16..31); ``w = d * (q - 8)``, run here as Q4 with ``m = -8 d`` (exact in fp16).
* Q4_1: ``d``, ``m`` fp16, ``qs`` as Q4_0; ``w = d * q + m``.

K-quants (``ggml-common.h`` ``block_q4_K`` / ``block_q6_K``; gguf-py ``Q4_K`` / ``Q6_K``), super-blocks of 256:

* Q4_K (144 bytes): ``d``, ``dmin`` fp16; 12 bytes of 6-bit ``sc_j``, ``m_j`` for 8 sub-blocks of 32
  (j < 4: low 6 bits of bytes j, j+4; j >= 4: low / high nibble of byte j+4 with the top two bits
  of bytes j-4, j); 128 bytes of nibbles (sub-block 2i: low nibbles of bytes 32i..32i+31, 2i+1: the
  high ones). ``w = (d*sc_j) * q - dmin*m_j``. Run as Q4 with per-32 ``d' = d*sc_j`` and
  ``m' = (-dmin)*m_j``, formed by the kernel in fp32 from the kept 6-bit ``sc_j``, ``m_j`` and the
  super-block's ``d``, ``-dmin``: both products are exact in fp32 (an 11-bit fp16 significand times a
  6-bit integer), so the kernel's weights are gguf's in value (``dequantize_packed`` == ``dequantize``).
* Q6_K (210 bytes): 128 bytes low nibbles ``ql``, 64 bytes high 2 bits ``qh``, 16 int8 scales (one
  per 16 weights), ``d`` fp16; in each half h of 128 weights, element 32s+l (s = 0..3, l = 0..31)
  is ``ql[64h + l + 32(s&1)]``'s low (s < 2) or high nibble | ``((qh[32h + l] >> 2s) & 3) << 4``;
  ``w = (d*sc_j) * (q - 32)``. Kept as a nibble plane (the Q4 layout) plus a plane of the top two
  bits, the int8 ``sc_j`` per 16 and ``d``; the kernel forms ``d*sc_j`` in fp32 (exact: 11 x 8 bits),
  so also equal in value.

Held per weight: Q4_K 4.75 bits (file: 4.5; d, -dmin as fp32 per 16 columns of a super-block); Q6_K
6.625 bits (file: 6.5625; d as fp32).

Other types raise :class:`UnsupportedQuantError` naming the tensor and type (``--quantization none``
dequantizes them at load).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

logger = logging.getLogger("tinyvllm")

FMT_Q8 = 0
FMT_Q4 = 1
FMT_Q4K = 2
FMT_Q6K = 3
SUPPORTED = ("Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
QUANTIZATION_MODES = ("auto", "gguf", "none")
_GROUP = 16


class UnsupportedQuantError(ValueError):
    """A GGUF tensor's type has no native kernel; the message names the tensor and the type."""


_INT8_ACTS: dict[tuple[int, torch.dtype], bool] = {}


def int8_activations(kern: Any, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether the native Q8_0 / Q4_0 / Q4_1 / Q4_K linears quantize their activations to int8 per
    row and 32-block (``gemm_gguf_q8``, llama.cpp's q8_0 / q8_1 scheme: VPDPBUSD on AVX512-VNNI,
    VPMADDUBSW / VPMADDWD on AVX2) or keep them as they are, bf16 or float32 (``gemm_gguf``).
    ``TINYVLLM_GGUF_ACTIVATIONS``: ``int8``, ``bf16`` (the model dtype's activations, float32 too), or
    ``auto`` (the default): int8 for bf16 activations where the VNNI kernel is built
    (``gemm_gguf_q8_isa() == "avx512_vnni"``: AVX512-BF16 and AVX512-VNNI, e.g. AMD Zen 4, where
    ``--quantization auto`` keeps the dequantized path, so native is the fast path a user asked for);
    a float32 model (``dtype``) keeps its activations under ``auto`` everywhere (a float32 user asked
    for the exact path: it equals the dequantized float32 model), and ``int8`` gives it llama.cpp's
    arithmetic. On AVX2 alone (AMD Zen 1-3), where
    ``--quantization auto`` runs native by default, ``auto`` keeps the activations unquantized: the
    default stays the more exact arithmetic (mean KL against float32 0.3x llama.cpp's, against ~1.1x with
    int8; docs/benchmarks.md) and ``int8`` is the fast one. Without either vector kernel ``int8`` runs
    the scalar loop (logged as slow). Fixed per process, so a model's arithmetic, and its greedy
    outputs, never change between steps.

    Raises:
        ValueError: another value of ``TINYVLLM_GGUF_ACTIVATIONS``.
    """
    key = (id(kern), dtype)
    if key not in _INT8_ACTS:
        from tinyvllm import envs

        mode = envs.TINYVLLM_GGUF_ACTIVATIONS
        if mode not in ("auto", "int8", "bf16"):
            raise ValueError(f"TINYVLLM_GGUF_ACTIVATIONS must be auto, int8 or bf16, not {mode!r}")
        isa = kern.gemm_gguf_q8_isa()
        vnni = isa == "avx512_vnni"
        if mode == "int8" and isa == "scalar":
            logger.warning("TINYVLLM_GGUF_ACTIVATIONS=int8 without an AVX512-VNNI or AVX2 kernel: the native "
                           "linears run gemm_gguf_q8's scalar loop (correct, many times slower)")
        _INT8_ACTS[key] = mode == "int8" or (mode == "auto" and vnni and dtype == torch.bfloat16)
    return _INT8_ACTS[key]


@dataclass
class QuantWeight:
    """A repacked [N, K] GGUF weight for :func:`gemm_gguf`.

    qs: uint8 [G, K/32, 8, 32] (Q4, Q4_K), int8 [G, K/32, 16, 32] (Q8) or uint8 [G, K/32, 384] (Q6_K:
    the low-nibble plane, then the top-two-bits plane), G = ceil(N/16);
    scales: float16 [G, K/32, 2 or 1, 16] (Q4: d then m; Q8: d); Q4_K: uint8 [G, K/256, 384] (per
    super-block: [8 blocks][sc, m][16] 6-bit values, then fp32 d[16], fp32 -dmin[16] as bytes);
    Q6_K: uint8 [G, K/256, 320] ([16 sub-blocks][16] int8 sc, then fp32 d[16] as bytes);
    fmt: one of the FMT_* codes (the layouts: the kernel's header comment);
    qtype: the GGUF type name it came from.
    """

    qs: torch.Tensor
    scales: torch.Tensor
    fmt: int
    n: int
    k: int
    qtype: str

    @property
    def nbytes(self) -> int:
        return self.qs.numel() * self.qs.element_size() + self.scales.numel() * self.scales.element_size()

    def run(self, kern: Any, x: torch.Tensor, bias: torch.Tensor | None, out_float: bool = False) -> torch.Tensor:
        """[..., k] bf16 or float32 -> [..., n] in x's dtype (float32 with ``out_float``: the kernel's
        float32 sums, not rounded to bf16; the LM head's logits) with ``kern.gemm_gguf_q8`` (int8
        activations, see :func:`int8_activations`) or ``kern.gemm_gguf`` (batch invariant either way)."""
        if self.fmt != FMT_Q6K and int8_activations(kern, x.dtype):
            return kern.gemm_gguf_q8(x, self.qs, self.scales, self.fmt, self.n, self.k, bias, out_float)
        return kern.gemm_gguf(x, self.qs, self.scales, self.fmt, self.n, self.k, bias, out_float)


@dataclass
class QuantParts:
    """A fused projection (Q/K/V, gate/up) whose parts have different formats (a Q4_K_M file's Q6_K
    ``attn_v`` next to Q4_K ``attn_q``/``attn_k``): each part runs on its own kernel call and the
    outputs are concatenated along N (row-wise, so still batch invariant)."""

    parts: list[QuantWeight]

    @property
    def n(self) -> int:
        return sum(p.n for p in self.parts)

    @property
    def k(self) -> int:
        return self.parts[0].k

    @property
    def qtype(self) -> str:
        return "+".join(sorted({p.qtype for p in self.parts}))

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def run(self, kern: Any, x: torch.Tensor, bias: torch.Tensor | None, out_float: bool = False) -> torch.Tensor:
        outs, o = [], 0
        for p in self.parts:
            outs.append(p.run(kern, x, None if bias is None else bias[o:o + p.n], out_float))
            o += p.n
        return torch.cat(outs, dim=-1)


def _blocks(raw: np.ndarray, n: int, k: int, block_bytes: int) -> np.ndarray:
    if k % 32:
        raise ValueError(f"row length {k} is not a multiple of 32")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 32, block_bytes)


def _pad_rows(a: np.ndarray, n: int) -> np.ndarray:
    pad = (-n) % _GROUP
    if pad:
        a = np.concatenate([a, np.zeros((pad, *a.shape[1:]), dtype=a.dtype)])
    return a


def repack(raw: np.ndarray, qtype: str, n: int, k: int, name: str = "?") -> QuantWeight:
    """Repack the raw GGUF bytes of an [n, k] tensor (``reader.tensors[i].data``: uint8 [n, row bytes],
    rows already in the model's order) into a :class:`QuantWeight`.

    Raises:
        UnsupportedQuantError: ``qtype`` is not one of :data:`SUPPORTED`.
    """
    if qtype == "Q8_0":
        b = _blocks(raw, n, k, 34)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]            # [n, nb]
        q = b[..., 2:34].view(np.int8)                              # [n, nb, 32]
        nb = k // 32
        q = _pad_rows(q, n).reshape(-1, _GROUP, nb, 16, 2).transpose(0, 2, 3, 1, 4)
        qs = np.ascontiguousarray(q).reshape(-1, nb, 16, 32)
        sc = _pad_rows(d, n).reshape(-1, _GROUP, nb).transpose(0, 2, 1)[:, :, None, :]
        fmt = FMT_Q8
    elif qtype in ("Q4_0", "Q4_1"):
        bb = 18 if qtype == "Q4_0" else 20
        b = _blocks(raw, n, k, bb)
        d = b[..., 0:2].copy().view(np.float16)[..., 0]
        if qtype == "Q4_1":
            m = b[..., 2:4].copy().view(np.float16)[..., 0]
        else:
            m = (d.astype(np.float32) * -8.0).astype(np.float16)   # exact: a power-of-two multiple
        nib = b[..., bb - 16:]
        q = np.concatenate([nib & 0xF, nib >> 4], axis=-1)          # [n, nb, 32] values 0..15
        nb = k // 32
        q = _pad_rows(q, n).reshape(-1, _GROUP, nb, 8, 4)
        byte = q[..., 0:2] | (q[..., 2:4] << 4)                     # [G, 16, nb, 8, 2]
        qs = np.ascontiguousarray(byte.transpose(0, 2, 3, 1, 4)).reshape(-1, nb, 8, 32)
        dm = np.stack([_pad_rows(d, n), _pad_rows(m, n)], axis=-1)  # [Np, nb, 2]
        sc = dm.reshape(-1, _GROUP, nb, 2).transpose(0, 2, 3, 1)
        fmt = FMT_Q4
    elif qtype == "Q4_K":
        q, d, dmin, scs, mns = _q4k_fields(raw, n, k)             # [n, nb, 32] 0..15; [n, ns]; [n, ns, 8]
        nb, ns = k // 32, k // 256
        q = _pad_rows(q, n).reshape(-1, _GROUP, nb, 8, 4)
        byte = q[..., 0:2] | (q[..., 2:4] << 4)
        qs = np.ascontiguousarray(byte.transpose(0, 2, 3, 1, 4)).reshape(-1, nb, 8, 32)
        sm = np.stack([_pad_rows(scs, n), _pad_rows(mns, n)], axis=-1)     # [Np, ns, 8, 2]
        sm = sm.reshape(-1, _GROUP, ns, 8, 2).transpose(0, 2, 3, 4, 1).reshape(-1, ns, 256)
        dd = np.stack([_pad_rows(d, n), _pad_rows(-dmin, n)], axis=-1)     # [Np, ns, 2] fp32
        dd = np.ascontiguousarray(dd.reshape(-1, _GROUP, ns, 2).transpose(0, 2, 3, 1)).view(np.uint8)
        sc = np.concatenate([sm.astype(np.uint8), dd.reshape(-1, ns, 128)], axis=-1)  # [G, ns, 384]
        fmt = FMT_Q4K
    elif qtype == "Q6_K":
        q, d, scs = _q6k_fields(raw, n, k)                         # [n, nb, 32] 0..63; [n, ns]; [n, ns, 16]
        nb, ns = k // 32, k // 256
        q = _pad_rows(q, n).reshape(-1, _GROUP, nb, 8, 4)          # [G, c, nb, j, k % 4]
        lo, hi = q & 0x0F, q >> 4
        lo = (lo[..., 0:2] | (lo[..., 2:4] << 4)).transpose(0, 2, 3, 1, 4).reshape(-1, nb, 256)
        h = hi[..., 0:2] | (hi[..., 2:4] << 2)                     # [G, c, nb, 8, 2]
        h = h.reshape(*h.shape[:3], 4, 2, 2)                       # chunk j = 2t + (0 | 1)
        h = (h[..., 0, :] | (h[..., 1, :] << 4)).transpose(0, 2, 3, 1, 4).reshape(-1, nb, 128)
        qs = np.concatenate([lo, h], axis=-1).astype(np.uint8)     # [G, nb, 384]
        s16 = _pad_rows(scs, n).reshape(-1, _GROUP, ns, 16).transpose(0, 2, 3, 1).reshape(-1, ns, 256)
        dd = np.ascontiguousarray(_pad_rows(d, n).reshape(-1, _GROUP, ns).transpose(0, 2, 1)).view(np.uint8)
        sc = np.concatenate([s16.view(np.uint8), dd], axis=-1)     # [G, ns, 320]
        fmt = FMT_Q6K
    else:
        raise UnsupportedQuantError(
            f"GGUF tensor {name!r} has type {qtype}, which has no native kernel (supported: "
            f"{', '.join(SUPPORTED)}); run with --quantization none to dequantize it at load")
    sdt = np.uint8 if fmt in (FMT_Q4K, FMT_Q6K) else np.float16
    return QuantWeight(torch.from_numpy(np.ascontiguousarray(qs)),
                       torch.from_numpy(np.ascontiguousarray(sc).astype(sdt)), fmt, n, k, qtype)


def _super_blocks(raw: np.ndarray, n: int, k: int, block_bytes: int) -> np.ndarray:
    if k % 256:
        raise ValueError(f"row length {k} is not a multiple of 256 (K-quant super-blocks)")
    return np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, k // 256, block_bytes)


def _q4k_ints(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K bytes -> (q uint8 [n, k/32, 32] in 0..15, d*sc fp32 [n, k/32], dmin*m fp32 [n, k/32]);
    the products are exact in fp32 (see the module docstring)."""
    q, d, dmin, sc, mn = _q4k_fields(raw, n, k)
    dsc = (d[..., None] * sc.astype(np.float32)).reshape(n, -1)
    dmn = (dmin[..., None] * mn.astype(np.float32)).reshape(n, -1)
    return q, dsc, dmn


def _q4k_fields(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, ...]:
    """Q4_K bytes -> (q uint8 [n, k/32, 32] in 0..15, d, dmin fp32 [n, k/256], sc, m uint8 [n, k/256, 8])."""
    b = _super_blocks(raw, n, k, 144)
    d = b[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)      # [n, ns]
    dmin = b[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    s = b[..., 4:16]
    lo, hi, mix = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([lo & 0x3F, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)  # [n, ns, 8]
    mn = np.concatenate([hi & 0x3F, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    nib = b[..., 16:144].reshape(n, -1, 4, 1, 32)                             # 4 chunks of 32 bytes
    q = np.concatenate([nib & 0x0F, nib >> 4], axis=-2).reshape(n, -1, 32)    # sub-blocks 2i, 2i+1
    return q, d, dmin, sc, mn


def _q6k_ints(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Q6_K bytes -> (q - 32 int8 [n, k/32, 32] in -32..31, d*sc fp32 [n, k/32, 2]: the scale of each
    block's two 16-weight sub-blocks); exact in fp32."""
    q, d, sc = _q6k_fields(raw, n, k)
    return (q.astype(np.int16) - 32).astype(np.int8), (d[..., None] * sc.astype(np.float32)).reshape(n, -1, 2)


def _q6k_fields(raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q6_K bytes -> (q uint8 [n, k/32, 32] in 0..63, d fp32 [n, k/256], sc int8 [n, k/256, 16])."""
    b = _super_blocks(raw, n, k, 210)
    ns = k // 256
    ql = b[..., 0:128].reshape(n, ns, 2, 64)
    qh = b[..., 128:192].reshape(n, ns, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=-1)                       # [n, ns, 2, 128]
    high = ((qh >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)) & 3).reshape(n, ns, 2, 128)
    q = (low | (high << 4)).reshape(n, -1, 32)
    d = b[..., 208:210].copy().view(np.float16)[..., 0].astype(np.float32)    # [n, ns]
    return q, d, b[..., 192:208].view(np.int8)


def dequantize_packed(w: QuantWeight) -> np.ndarray:
    """The float32 [n, k] weight a :class:`QuantWeight` holds (``d*q`` or ``d*q + m`` in float32, as
    ``gguf.quants.dequantize``; Q4_K: ``(d*sc)*q - dmin*m``): a test of the repack."""
    qs, sc = w.qs.numpy(), w.scales.numpy()
    g, nb = qs.shape[0], qs.shape[1]
    if w.fmt == FMT_Q4K:  # back to the [G, nb, 2, 16] fp32 (d*sc, -dmin*m) form of the Q4 branch
        ns = nb // 8
        sm = sc[..., :256].reshape(g, ns, 8, 2, 16).astype(np.float32)
        dd = np.ascontiguousarray(sc[..., 256:]).view(np.float32).reshape(g, ns, 1, 2, 16)
        sc = (dd * sm).reshape(g, nb, 2, 16)
    if w.fmt == FMT_Q6K:
        ns = nb // 8
        lo = qs[..., :256].reshape(g, nb, 8, 16, 2).transpose(0, 3, 1, 2, 4)          # [G, c, nb, j, e]
        lo = np.concatenate([lo & 0x0F, lo >> 4], axis=-1)                            # k % 4 = e, 2 + e
        hb = qs[..., 256:].reshape(g, nb, 4, 16, 2).transpose(0, 3, 1, 2, 4)          # [G, c, nb, t, e]
        h = np.stack([hb & 0x0F, hb >> 4], axis=-2).reshape(g, 16, nb, 8, 2)           # chunk j = 2t, 2t+1
        hi = np.concatenate([h & 3, (h >> 2) & 3], axis=-1)
        q = ((lo | (hi << 4)).astype(np.float32) - 32).reshape(g * 16, nb, 2, 16)
        s16 = sc[..., :256].view(np.int8).reshape(g, ns, 16, 16).astype(np.float32)   # [G, ns, sub, c]
        d = np.ascontiguousarray(sc[..., 256:]).view(np.float32).reshape(g, ns, 1, 16)
        scale = (d * s16).transpose(0, 3, 1, 2).reshape(g * 16, nb, 2, 1)
        return (scale * q).reshape(g * 16, nb * 32)[: w.n]
    sc = sc.astype(np.float32)
    if w.fmt == FMT_Q8:
        q = qs.reshape(g, nb, 16, 16, 2).transpose(0, 3, 1, 2, 4).reshape(g * 16, nb, 32).astype(np.float32)
        d = sc[:, :, 0, :].transpose(0, 2, 1).reshape(g * 16, nb, 1)
        out = d * q
    else:
        byte = qs.reshape(g, nb, 8, 16, 2).transpose(0, 3, 1, 2, 4)   # [G, 16, nb, 8, 2]
        q = np.concatenate([byte & 0xF, byte >> 4], axis=-1).reshape(g * 16, nb, 32).astype(np.float32)
        d = sc[:, :, 0, :].transpose(0, 2, 1).reshape(g * 16, nb, 1)
        m = sc[:, :, 1, :].transpose(0, 2, 1).reshape(g * 16, nb, 1)
        out = d * q + m
    return out.reshape(g * 16, nb * 32)[: w.n]


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a converted model directory came from (loader's conversion marker), or None."""
    from tinyvllm.model.loader import _CONVERSION_MARKER

    marker = Path(model_dir) / _CONVERSION_MARKER
    try:
        src = Path(json.loads(marker.read_text())["source"])
    except (OSError, ValueError, KeyError):
        return None
    return src if src.is_file() else None


# GGUF tensor name suffix -> (our fused Linear attribute path, row offset kind)
_LAYER_LINEARS = {
    "attn_q.weight": ("self_attn.qkv_proj", "q"), "attn_k.weight": ("self_attn.qkv_proj", "k"),
    "attn_v.weight": ("self_attn.qkv_proj", "v"), "attn_output.weight": ("self_attn.o_proj", None),
    "ffn_gate.weight": ("mlp.gate_up_proj", "gate"), "ffn_up.weight": ("mlp.gate_up_proj", "up"),
    "ffn_down.weight": ("mlp.down_proj", None),
}


# llama.cpp's stacked expert tensors (qwen3moe) -> (per-expert Linear under layers.N.mlp.experts.E, part)
_EXPERT_LINEARS = {"ffn_gate_exps.weight": ("gate_up_proj", "gate"), "ffn_up_exps.weight": ("gate_up_proj", "up"),
                   "ffn_down_exps.weight": ("down_proj", None)}


def _fuse(parts: list[QuantWeight]) -> QuantWeight | QuantParts:
    """Stack weights along N (Q/K/V, gate/up). Each part's N must be a multiple of 16 (the groups
    then concatenate). Consecutive parts of one format become one weight; mixed formats give a
    :class:`QuantParts` of those runs."""
    if len(parts) == 1:
        return parts[0]
    if any(p.n % _GROUP for p in parts):
        raise UnsupportedQuantError("fused projections with N not a multiple of 16")
    runs: list[list[QuantWeight]] = []
    for p in parts:
        if runs and runs[-1][0].fmt == p.fmt:
            runs[-1].append(p)
        else:
            runs.append([p])
    fused = [r[0] if len(r) == 1 else
             QuantWeight(torch.cat([p.qs for p in r]), torch.cat([p.scales for p in r]), r[0].fmt,
                         sum(p.n for p in r), r[0].k, "+".join(sorted({p.qtype for p in r}))) for r in runs]
    return fused[0] if len(fused) == 1 else QuantParts(fused)


def _read_gguf(gguf_path: str | Path, n_head: int, n_kv: int) -> dict[str, Any]:
    """Parse the GGUF once and repack every supported quantized linear (and the LM head).

    Returns ``{"weights": {"layers.{i}.{attr}" | "lm_head": QuantWeight | QuantParts}, "lm_head_tied": bool,
    "unsupported": [(tensor name, type)], "quantized": bool}``. A fused projection (Q/K/V, gate/up)
    with any unsupported or unquantized part is left out (it keeps its dequantized weight).
    """
    from tinyvllm.model.loader import GGUF_PERMUTED_QK, _gguf_field, _unpermute_qk, gguf_reader

    reader = gguf_reader(gguf_path)
    permuted = _gguf_field(reader, "general.architecture", "llama") in GGUF_PERMUTED_QK
    parts: dict[int, dict[str, dict[str | None, QuantWeight]]] = {}
    head = embd = None
    unsupported: list[tuple[str, str]] = []
    quantized = False
    for t in reader.tensors:
        qtype = t.tensor_type.name
        is_head = t.name in ("output.weight", "token_embd.weight")
        rest = t.name.split(".", 2)[2] if t.name.startswith("blk.") else None
        if rest in _EXPERT_LINEARS:  # stacked MoE experts [E, n, k]: each expert its own weight
            if qtype in ("F32", "F16", "BF16"):
                continue
            if qtype not in SUPPORTED:
                unsupported.append((t.name, qtype))
                continue
            quantized = True
            k, n, n_exp = (int(x) for x in t.shape[:3])
            raw = np.asarray(t.data).reshape(n_exp, n, -1)
            idx = int(t.name.split(".")[1])
            proj, kind = _EXPERT_LINEARS[rest]
            for e in range(n_exp):
                parts.setdefault(idx, {}).setdefault(f"mlp.experts.{e}.{proj}", {})[kind] = repack(
                    raw[e], qtype, n, k, f"{t.name}[{e}]")
            continue
        if not is_head and rest not in _LAYER_LINEARS:
            continue
        if qtype in ("F32", "F16", "BF16"):
            continue
        if qtype not in SUPPORTED:
            unsupported.append((t.name, qtype))
            continue
        k, n = (int(x) for x in t.shape[:2])
        if is_head:
            w = repack(t.data, qtype, n, k, t.name)
            if t.name == "output.weight":
                head = w
            else:
                embd = w
            continue
        quantized = True
        idx = int(t.name.split(".")[1])
        attr, kind = _LAYER_LINEARS[rest]
        raw = t.data
        if kind in ("q", "k") and permuted:
            raw = _unpermute_qk(np.asarray(raw), n_head if kind == "q" else n_kv)
        parts.setdefault(idx, {}).setdefault(attr, {})[kind] = repack(raw, qtype, n, k, t.name)
    order = {"self_attn.qkv_proj": ("q", "k", "v"), "mlp.gate_up_proj": ("gate", "up")}
    weights: dict[str, QuantWeight | QuantParts] = {}
    for i, by in parts.items():
        for attr, d in by.items():
            need = order.get(attr, ("gate", "up") if attr.endswith("gate_up_proj") else (None,))
            if all(x in d for x in need):
                weights[f"layers.{i}.{attr}"] = _fuse([d[x] for x in need])
    tied = head is None
    if (head if head is not None else embd) is not None:
        weights["lm_head"] = head if head is not None else embd
    return {"weights": weights, "lm_head_tied": tied, "unsupported": unsupported, "quantized": quantized}


NATIVE_CACHE_VERSION = 3  # 2: Q4_K / Q6_K, mixed-format fused parts; 3: Q4_K's compact scales


def native_cache_path(gguf_path: str | Path) -> tuple[Path, str]:
    """Where the repacked weights of ``gguf_path`` are cached (``$TINYVLLM_CACHE/weights``), and their
    key (resolved path, size, mtime, the layout version, mode ``gguf``)."""
    import hashlib

    from tinyvllm import envs

    p = Path(gguf_path).resolve()
    st = p.stat()
    key = hashlib.sha256(f"{p}|{st.st_size}|{st.st_mtime_ns}|gguf-native|v{NATIVE_CACHE_VERSION}".encode()).hexdigest()
    return envs.TINYVLLM_CACHE / "weights" / f"{p.stem}-gguf-native-{key[:16]}.safetensors", key


def _cache_entry(w: QuantWeight | QuantParts) -> list[Any]:
    if isinstance(w, QuantParts):
        return ["parts", [[p.fmt, p.n, p.k, p.qtype] for p in w.parts]]
    return [w.fmt, w.n, w.k, w.qtype]


def _from_cache(fh: Any, name: str, e: list[Any]) -> QuantWeight | QuantParts:
    if e[0] == "parts":
        return QuantParts([QuantWeight(fh.get_tensor(f"{name}.p{i}.qs"), fh.get_tensor(f"{name}.p{i}.scales"), *pe)
                           for i, pe in enumerate(e[1])])
    return QuantWeight(fh.get_tensor(name + ".qs"), fh.get_tensor(name + ".scales"), *e)


def load_native(gguf_path: str | Path, n_head: int, n_kv: int) -> dict[str, Any]:
    """:func:`_read_gguf`'s result, from the cache file when it is there (mapped: no parse, no repack);
    otherwise parsed, repacked and written to the cache (temp name + rename; best effort)."""
    import os
    import tempfile

    from safetensors import safe_open
    from safetensors.torch import save_file

    path, key = native_cache_path(gguf_path)
    if path.is_file():
        try:
            with safe_open(str(path), framework="pt") as fh:
                meta = json.loads((fh.metadata() or {}).get("tinyvllm_native", "{}"))
                if meta.get("key") == key:
                    weights = {name: _from_cache(fh, name, e) for name, e in meta["entries"].items()}
                    return {"weights": weights, "lm_head_tied": meta["lm_head_tied"],
                            "unsupported": [tuple(u) for u in meta["unsupported"]], "quantized": meta["quantized"]}
        except Exception as e:  # noqa: BLE001 - corrupt: rebuild
            logger.warning("native GGUF cache %s unreadable (%s); rebuilding it", path, e)
    import time

    t0 = time.monotonic()
    logger.info("repacking the GGUF blocks of %s for the native kernels (first run) ...", Path(gguf_path).name)
    out = _read_gguf(gguf_path, n_head, n_kv)
    logger.info("repacked the GGUF blocks in %.1fs", time.monotonic() - t0)
    meta = {"key": key, "lm_head_tied": out["lm_head_tied"], "unsupported": out["unsupported"],
            "quantized": out["quantized"],
            "entries": {n: _cache_entry(w) for n, w in out["weights"].items()}}
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {}
        for n, w in out["weights"].items():
            for i, p in enumerate(w.parts if isinstance(w, QuantParts) else [w]):
                key_ = n if not isinstance(w, QuantParts) else f"{n}.p{i}"
                tensors[key_ + ".qs"], tensors[key_ + ".scales"] = p.qs, p.scales
        fd, tmp = tempfile.mkstemp(prefix=".native-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata={"tinyvllm_native": json.dumps(meta)})
        os.replace(tmp, path)
        tmp = None
    except Exception as e:  # noqa: BLE001 - a read-only cache only costs start time
        logger.warning("cannot write native GGUF cache %s (%s)", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
    return out


def resolve_quantization(mode: str, model_dir: str | Path, dtype: torch.dtype, device: str | torch.device,
                         load_format: str = "auto") -> Path | None:
    """The GGUF file to run natively, or None for the dequantized path.

    ``auto`` (the default): native where it is the faster path. That is: ``model_dir`` was converted
    from a GGUF whose linears are quantized, the dtype is bfloat16 (a float32 model keeps the exact
    dequantized path under ``auto``), the device is the CPU, the C++
    kernels have a vector ``gemm_gguf`` (AVX512-BF16 or AVX2 + FMA) and no packed bf16 GEMM (no
    AVX512-BF16: AMD Zen 1-3, Intel before Cooper Lake). There the dequantized path is PyTorch's bf16
    ``F.linear`` in padded row slabs, which native beat 2-4x per linear and 12x per batch-1 decode
    step (docs/benchmarks.md, "Native GGUF on AVX2"). With AVX512-BF16 the packed bf16 GEMM (AMX or
    ``vdpbf16ps``) is faster from 8 rows up and invariance forbids switching kernels by rows, so
    ``auto`` keeps it. ``gguf``: native is required wherever it can run (the kernels' portable
    scalar loop where no vector kernel is built), in bfloat16 or float32: float32 activations feed
    the kernels unrounded and the linears' outputs stay float32, so with int8 activations the
    arithmetic is llama.cpp's (activations quantized from float32, float32 everywhere else).
    ``none``: None.

    Raises:
        ValueError: ``gguf`` where it cannot run (not a quantized GGUF, another dtype or device, no C++
            kernels), naming what is missing.
    """
    if mode == "none" or load_format == "dummy":
        if mode == "gguf":
            raise ValueError("quantization='gguf' needs the GGUF's weights; not with load_format='dummy'")
        return None
    src = gguf_source(model_dir)
    why = None
    if src is None:
        why = "the model is not a GGUF file"
    elif dtype not in (torch.bfloat16, torch.float32):
        why = f"native GGUF runs bfloat16 or float32 activations, not {dtype} (or use --quantization none)"
    elif mode == "auto" and dtype != torch.bfloat16:
        why = f"auto runs native GGUF in bfloat16 only, not {dtype} (--quantization gguf runs it in float32)"
    elif torch.device(device).type != "cpu":
        why = f"native GGUF kernels run on the CPU, not {device}"
    else:
        from tinyvllm.kernels.cpu import cpu_kernels

        kern = cpu_kernels()
        if kern is None:
            why = "the C++ CPU kernels are not built"
        elif mode == "auto" and kern.gemm_has_bf16_kernel():
            why = "the packed bf16 GEMM (AVX512-BF16) is faster here from 8 rows up; --quantization gguf forces native"
        elif mode == "auto" and kern.gemm_gguf_isa() == "scalar":
            why = "neither AVX512-BF16 nor AVX2 (the portable loop is slow; --quantization gguf forces it)"
    if why is None:
        return src
    if mode == "gguf":
        raise ValueError(f"quantization='gguf' cannot run: {why}")
    if src is not None:  # (auto on a model that is not a GGUF: nothing to say)
        logger.info("GGUF weights dequantized at load (%s)", why)
    return None


def attach_gguf_quant(model: Any, gguf_path: str | Path, *, strict: bool) -> int:
    """Replace ``model``'s linear weights (and the LM head) by their repacked GGUF blocks
    (:func:`load_native`: cached after the first load).

    Linears whose GGUF tensors are unquantized (F32/F16/BF16) keep their dequantized weight. With
    ``strict`` (``--quantization gguf``), a tensor of another quantized type raises; otherwise that
    linear keeps its dequantized weight (logged: the documented per-tensor fallback).

    Returns:
        bytes of the quantized weights now used (0: the file has no quantized linears; nothing changed).
    Raises:
        UnsupportedQuantError: ``strict`` and an unsupported tensor type (the message names it), or
            ``strict`` and no quantized linear at all.
        ValueError: a tensor's shape does not match the model.
    """
    from tinyvllm.kernels.cpu import cpu_kernels

    kern = cpu_kernels()
    cfg = model.config
    q = load_native(gguf_path, cfg.num_attention_heads, cfg.num_key_value_heads)
    unsupported = q["unsupported"]
    if unsupported and strict:
        name, qtype = unsupported[0]
        raise UnsupportedQuantError(
            f"GGUF tensor {name!r} has type {qtype}, which has no native kernel (supported: {', '.join(SUPPORTED)}); "
            f"{len(unsupported)} such tensor(s). Run with --quantization none (or auto) to dequantize them at load")
    if not q["quantized"]:
        if strict:
            raise UnsupportedQuantError(f"GGUF {Path(gguf_path).name} has no quantized linear tensors")
        return 0
    if unsupported:
        logger.warning("GGUF: %d tensor(s) of types without a native kernel are dequantized at load: %s",
                       len(unsupported), ", ".join(f"{n} ({t})" for n, t in unsupported[:5]))
    total = 0
    for name, w in q["weights"].items():
        if name == "lm_head":
            continue
        _, i, attr = name.split(".", 2)
        lin = model.layers[int(i)].get_submodule(attr)
        if (w.n, w.k) != (lin.out_features, lin.in_features):
            raise ValueError(f"GGUF {name}: shape {(w.n, w.k)} != model {(lin.out_features, lin.in_features)}")
        lin.quantize(w, kern)
        total += w.nbytes
    head = q["weights"].get("lm_head")
    if head is not None:
        if (head.n, head.k) != (cfg.vocab_size, cfg.hidden_size):
            raise ValueError(f"GGUF LM head: shape {(head.n, head.k)} != {(cfg.vocab_size, cfg.hidden_size)}")
        if model.lm_head is not None and not q["lm_head_tied"]:
            model.lm_head.quantize(head, kern)
            total += head.nbytes
        elif model.lm_head is None and q["lm_head_tied"]:
            model.lm_head_quant = head
            model.lm_head_quant_kern = kern
            total += head.nbytes
    model.quantization = "gguf"
    return total
