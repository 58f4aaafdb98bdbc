"""Write a random-weight Llama GGUF with quantized blocks (for benchmarks and tests of the native GGUF
path at sizes no embedded model has, e.g. Llama-3.2-1B's shape).

The blocks are written directly from random integers with sane scales (``gguf``'s numpy quantizer is
far too slow for a 1B model): per block ``d`` (and ``m``) in fp16 such that the weights have mean ~0
and standard deviation ~``in_features ** -0.5`` (the embedding: 0.02), which keeps activations O(1)
through any depth. The tokenizer (and its chat template) is copied from a source GGUF (default: the
embedded SmolLM2's); a larger ``vocab`` is padded with unused ``<|pad_N|>`` tokens. Never commit the
output: generate it under ``/tmp`` or ``$TINYVLLM_CACHE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

LLAMA_3_2_1B = dict(hidden=2048, layers=16, heads=32, kv_heads=8, inter=8192, vocab=128256, rope_theta=500000.0)
_BLOCK_BYTES = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q4_K": 144, "Q6_K": 210}  # K-quants: per 256 weights
_BLOCK_WEIGHTS = {"Q4_K": 256, "Q6_K": 256}
# Q4_K_M's recipe (llama.cpp llama-quant.cpp, simplified): Q6_K for attn_v and ffn_down in the first
# and last eighth of the layers and every third one between; Q4_K for the other linears.
Q4_K_M = "Q4_K_M"


def random_blocks(rng: np.random.Generator, n: int, k: int, qtype: str, std: float) -> np.ndarray:
    """Raw GGUF bytes [n, k/32 * block bytes] (K-quants: k/256 * block bytes) of an [n, k] tensor of
    ``qtype`` with weights of std ~``std``. The K-quants' 6-bit scales and mins cover their whole
    range's bit patterns (the high bits of the packed scales included), Q6_K's int8 scales both signs."""
    if qtype in _BLOCK_WEIGHTS:
        return _random_kquant(rng, n, k, qtype, std)
    nb = k // 32
    out = np.empty((n, nb, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=(n, nb)).astype(np.float32)
    if qtype == "Q8_0":
        d = (std / 73.0 * jitter).astype(np.float16)
        out[..., 0:2] = d[..., None].view(np.uint8).reshape(n, nb, 2)
        out[..., 2:] = rng.integers(-127, 128, size=(n, nb, 32), dtype=np.int8).view(np.uint8)
    else:
        d = (std / 4.6 * jitter).astype(np.float16)
        out[..., 0:2] = d[..., None].view(np.uint8).reshape(n, nb, 2)
        off = 2
        if qtype == "Q4_1":
            m = (-7.5 * d.astype(np.float32)).astype(np.float16)
            out[..., 2:4] = m[..., None].view(np.uint8).reshape(n, nb, 2)
            off = 4
        out[..., off:] = rng.integers(0, 256, size=(n, nb, 16), dtype=np.uint8)
    return out.reshape(n, -1)


def _random_kquant(rng: np.random.Generator, n: int, k: int, qtype: str, std: float) -> np.ndarray:
    if k % 256:
        raise ValueError(f"{qtype} needs a row length that is a multiple of 256, not {k}")
    ns = k // 256
    out = np.empty((n, ns, _BLOCK_BYTES[qtype]), dtype=np.uint8)
    jitter = rng.uniform(0.5, 1.5, size=(n, ns)).astype(np.float32)
    if qtype == "Q4_K":
        # w = d*sc*q - dmin*m, q uniform 0..15 (mean 7.5, std 4.6): sc in 8..63 (mean ~35.5) and
        # m ~ sc (+-3) with dmin = 7.5 d keep each sub-block's mean near 0.
        sc = rng.integers(8, 64, size=(n, ns, 8))
        mn = np.clip(sc + rng.integers(-3, 4, size=sc.shape), 0, 63)
        d = (std / 4.6 / 35.5 * jitter).astype(np.float16)
        dmin = (7.5 * d.astype(np.float32)).astype(np.float16)
        out[..., 0:2] = d[..., None].view(np.uint8).reshape(n, ns, 2)
        out[..., 2:4] = dmin[..., None].view(np.uint8).reshape(n, ns, 2)
        out[..., 4:16] = _pack_scale_min_k4(sc, mn)
        out[..., 16:] = rng.integers(0, 256, size=(n, ns, 128), dtype=np.uint8)
    else:  # Q6_K: w = d*sc*(q-32), q-32 uniform -32..31 (std ~18.5), sc int8 of rms ~73
        d = (std / 18.5 / 73.0 * jitter).astype(np.float16)
        out[..., 0:192] = rng.integers(0, 256, size=(n, ns, 192), dtype=np.uint8)
        out[..., 192:208] = rng.integers(-127, 128, size=(n, ns, 16), dtype=np.int8).view(np.uint8)
        out[..., 208:210] = d[..., None].view(np.uint8).reshape(n, ns, 2)
    return out.reshape(n, -1)


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """[..., 8] 6-bit scales and mins -> the 12 packed bytes of a Q4_K super-block (the inverse of the
    unpacking in :mod:`tinyvllm.model.gguf_quant`)."""
    sc, mn = sc.astype(np.uint8), mn.astype(np.uint8)
    b = np.empty((*sc.shape[:-1], 12), dtype=np.uint8)
    b[..., 0:4] = (sc[..., 0:4] & 0x3F) | ((sc[..., 4:8] >> 4) << 6)
    b[..., 4:8] = (mn[..., 0:4] & 0x3F) | ((mn[..., 4:8] >> 4) << 6)
    b[..., 8:12] = (sc[..., 4:8] & 0x0F) | ((mn[..., 4:8] & 0x0F) << 4)
    return b


def q4_k_m_type(name: str, layers: int) -> str | None:
    """The type :data:`Q4_K_M` gives a layer linear ``blk.{i}.{...}.weight`` (None: Q4_K)."""
    if not name.startswith("blk.") or not (name.endswith("attn_v.weight") or name.endswith("ffn_down.weight")):
        return None
    i = int(name.split(".")[1])
    return "Q6_K" if i < layers // 8 or i >= 7 * layers // 8 or (i - layers // 8) % 3 == 2 else None


def write_random_gguf(path: str | Path, *, hidden: int, layers: int, heads: int, kv_heads: int, inter: int,
                      vocab: int | None = None, qtype: str = "Q4_1", embd_qtype: str = "Q8_0",
                      rope_theta: float = 10000.0, tokenizer_from: str | Path | None = None,
                      tensor_types: dict[str, str] | None = None, seed: int = 0, embd_std: float = 0.02) -> Path:
    """Write the GGUF; return its path.

    Args:
        qtype: type of every layer linear, or :data:`Q4_K_M` (Q4_K, and Q6_K for some ``attn_v`` /
            ``ffn_down``: :func:`q4_k_m_type`); ``embd_qtype``: of ``token_embd`` (tied LM head).
        tensor_types: per tensor name, a type overriding those (tests: an unsupported type). A type
            without a writer here gets random bytes of its block size from ``gguf.GGML_QUANT_SIZES``.
        vocab: default the source tokenizer's size; larger pads with unused tokens.
        embd_std: the embedding's (tied LM head's) weight std; larger gives peakier next-token
            distributions (tests comparing logprobs want a top token well above the rest).
    """
    import gguf

    from tinyvllm.model.loader import DEFAULT_MODEL_ALIAS, _find_alias_gguf, gguf_reader

    src = gguf_reader(tokenizer_from or _find_alias_gguf(DEFAULT_MODEL_ALIAS))
    tokens = list(src.fields["tokenizer.ggml.tokens"].contents())
    token_type = list(src.fields["tokenizer.ggml.token_type"].contents())
    vocab = vocab or len(tokens)
    if vocab < len(tokens):
        raise ValueError(f"vocab {vocab} is smaller than the source tokenizer's {len(tokens)}")
    tokens += [f"<|pad_{i}|>" for i in range(vocab - len(tokens))]
    token_type += [4] * (vocab - len(token_type))  # USER_DEFINED
    rng = np.random.default_rng(seed)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(layers)
    w.add_context_length(4096)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(hidden // heads)
    w.add_vocab_size(vocab)
    w.add_file_type({"Q4_1": 3, "Q4_0": 2, "Q4_K": 14, Q4_K_M: 15, "Q6_K": 18}.get(qtype, 7))
    for key, field in src.fields.items():
        if not key.startswith("tokenizer.") or key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type"):
            continue
        vt = field.types[0]
        w.add_key_value(key, field.contents(), vt, field.types[1] if vt == gguf.GGUFValueType.ARRAY else None)
    w.add_token_list(tokens)
    w.add_token_types(token_type)
    types = tensor_types or {}
    hd = hidden // heads

    def add(name: str, n: int, k: int, t: str, std: float) -> None:
        if t == Q4_K_M:
            t = q4_k_m_type(name, layers) or "Q4_K"
        t = types.get(name, t)
        if t in _BLOCK_BYTES:
            raw = random_blocks(rng, n, k, t, std)
        else:
            qt = gguf.GGMLQuantizationType[t]
            bsize, tsize = gguf.GGML_QUANT_SIZES[qt]
            raw = rng.integers(0, 256, size=(n, k // bsize, tsize), dtype=np.uint8)
            # a sane fp16 scale in each block's first two bytes (where Q5_x and the K-quants keep d)
            raw[..., 0:2] = np.full((n, k // bsize, 1), std / 16, dtype=np.float16).view(np.uint8)
            raw = raw.reshape(n, -1)
        w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[t])  # raw: [n, bytes per row]

    add("token_embd.weight", vocab, hidden, embd_qtype, embd_std)
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    for i in range(layers):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", np.ones(hidden, dtype=np.float32))
        w.add_tensor(p + "ffn_norm.weight", np.ones(hidden, dtype=np.float32))
        add(p + "attn_q.weight", heads * hd, hidden, qtype, hidden ** -0.5)
        add(p + "attn_k.weight", kv_heads * hd, hidden, qtype, hidden ** -0.5)
        add(p + "attn_v.weight", kv_heads * hd, hidden, qtype, hidden ** -0.5)
        add(p + "attn_output.weight", hidden, heads * hd, qtype, (heads * hd) ** -0.5)
        add(p + "ffn_gate.weight", inter, hidden, qtype, hidden ** -0.5)
        add(p + "ffn_up.weight", inter, hidden, qtype, hidden ** -0.5)
        add(p + "ffn_down.weight", hidden, inter, qtype, inter ** -0.5)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _main(argv: list[str] | None = None) -> None:
    import argparse

    ap = argparse.ArgumentParser(description="write a random-weight Llama GGUF (Llama-3.2-1B's shape by default)")
    ap.add_argument("out")
    ap.add_argument("--qtype", default="Q4_1", choices=sorted(_BLOCK_BYTES) + [Q4_K_M])
    ap.add_argument("--embd-qtype", default="Q8_0", choices=sorted(_BLOCK_BYTES))
    args = ap.parse_args(argv)
    kw: dict[str, Any] = dict(LLAMA_3_2_1B)
    print(write_random_gguf(args.out, qtype=args.qtype, embd_qtype=args.embd_qtype, **kw))


if __name__ == "__main__":
    _main()
