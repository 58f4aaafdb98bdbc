"""Weight loading: build a model (the family :mod:`tinyvllm.model.registry` picks, a
:class:`~tinyvllm.model.llama.LlamaForCausalLM` or subclass) from an HF-style directory
(:func:`load_model`), copy HF-named tensors into its fused parameters (:func:`load_weights`), or fill
it with seeded random weights (:func:`init_dummy_weights`, ``--load-format dummy``).

**Prepared weights.** The first load of a model in a dtype also writes its parameters, in the
model's own layout (Q/K/V and gate/up fused) and dtype, to one safetensors file under
``$TINYVLLM_CACHE/weights`` (:func:`prepared_weights_path`). Later loads map that file and
assign its tensors as the parameters: no conversion, no copy, pages read as they are touched
(the embedded SmolLM2's float32 -> bfloat16 load: 1.4 s -> ~0.1 s). The file is keyed by the
source's identity (resolved directory; name, size and mtime of ``config.json`` and every
``*.safetensors``), the dtype and a format version, and carries that key in its metadata; it is
written under a temporary name and renamed, so a partial file is never seen. A file whose key,
tensor names, shapes or dtypes do not match, or that cannot be read, is ignored and rewritten.
Sources smaller than :data:`PREPARED_MIN_BYTES` (test models) load in milliseconds and are not cached.
"""

from __future__ import annotations

import hashlib
import logging
import os
import tempfile
from pathlib import Path
from typing import Iterable

import torch

from tinyvllm import envs
from tinyvllm.config import LOAD_FORMATS
from tinyvllm.model.llama import LlamaForCausalLM

logger = logging.getLogger("tinyvllm")
PREPARED_VERSION = 2  # 2: Gemma 3 norm weights are stored as w (HF), not 1 + w
PREPARED_MIN_BYTES = 32 << 20  # smaller sources load in milliseconds: not worth a cache file
_KEY_META = "tinyvllm_prepared_key"


def load_weights(model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors (``model.layers.N.self_attn.q_proj.weight`` ...) into ``model``.

    Q/K/V are packed into ``qkv_proj`` and gate/up into ``gate_up_proj``.

    Raises:
        ValueError: an unexpected tensor name or shape, or missing tensors.
        RuntimeError: the weights were already packed by ``model.pack_for_cpu``.
    """
    if model.packed:
        raise RuntimeError("weights are packed for the CPU GEMM (pack_for_cpu); build a new model to load weights")
    params = dict(model.named_parameters())
    loaded: set[str] = set()
    cfg = model.config
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    inter = cfg.intermediate_size
    shard = {
        "q_proj": ("qkv_proj", 0, q), "k_proj": ("qkv_proj", q, kv), "v_proj": ("qkv_proj", q + kv, kv),
        "gate_proj": ("gate_up_proj", 0, inter), "up_proj": ("gate_up_proj", inter, inter),
    }
    for name, tensor in (pair for n0, t0 in weights for pair in model.remap_weight(n0, t0)):
        if "rotary_emb.inv_freq" in name:
            continue
        n = name[len("model."):] if name.startswith("model.") else name
        if n == "lm_head.weight" and model.lm_head is None:
            continue  # tied: the embedding is the head
        parts = n.split(".")
        target, offset, size = n, None, None
        if len(parts) >= 2 and parts[-2] in shard:
            fused, offset, size = shard[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            if fused == "gate_up_proj" and target in params:  # each MLP's own width (MoE experts: their own)
                half = params[target].shape[0] // 2
                offset, size = (0 if parts[-2] == "gate_proj" else half), half
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


def prepared_weights_path(model_dir: str | Path, dtype: torch.dtype) -> tuple[Path, str]:
    """Where the prepared (model layout, ``dtype``) weights of ``model_dir`` are cached, and their key.

    The key hashes the resolved directory, the name, size and mtime of ``config.json`` and of every
    ``*.safetensors`` file, the dtype and :data:`PREPARED_VERSION`: changing any source file changes
    the key, so a stale file is never used.
    """
    model_dir = Path(model_dir).resolve()
    parts = [str(model_dir), str(dtype), f"v{PREPARED_VERSION}"]
    for f in [model_dir / "config.json", *sorted(model_dir.glob("*.safetensors"))]:
        st = f.stat()
        parts.append(f"{f.name}|{st.st_size}|{st.st_mtime_ns}")
    key = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    name = f"{model_dir.name}-{str(dtype).replace('torch.', '')}-{key[:16]}.safetensors"
    return envs.TINYVLLM_CACHE / "weights" / name, key


def _load_prepared(path: Path, key: str, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """The tensors of the prepared file ``path`` (views of its mapping), or None if it is missing or
    does not match ``key`` and ``expected``'s names, shapes and dtypes exactly."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as fh:
            if (fh.metadata() or {}).get(_KEY_META) != key:
                logger.warning("prepared weights %s: key mismatch; rebuilding them", path)
                return None
            if set(fh.keys()) != set(expected):
                logger.warning("prepared weights %s: tensor names differ from the model's; rebuilding them", path)
                return None
            out = {}
            for name, want in expected.items():
                t = fh.get_tensor(name)
                if t.shape != want.shape or t.dtype != want.dtype:
                    logger.warning("prepared weights %s: %s is %s %s, expected %s %s; rebuilding them", path,
                                   name, tuple(t.shape), t.dtype, tuple(want.shape), want.dtype)
                    return None
                out[name] = t
        return out
    except Exception as e:  # noqa: BLE001 - truncated, corrupt header...: rebuild
        logger.warning("prepared weights %s unreadable (%s); rebuilding them", path, e)
        return None


def _save_prepared(path: Path, key: str, model: LlamaForCausalLM, source: Path) -> None:
    """Write ``model``'s parameters to ``path`` (temp name + rename: never a partial file). Best effort."""
    from safetensors.torch import save_file

    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()}
        fd, tmp = tempfile.mkstemp(prefix=".prepared-", suffix=".tmp", dir=path.parent)
        os.close(fd)
        save_file(tensors, tmp, metadata={_KEY_META: key, "source": str(source)})
        os.replace(tmp, path)
        tmp = None
        logger.info("prepared weights written to %s", path)
    except Exception as e:  # noqa: BLE001 - a read-only cache only costs speed
        logger.warning("cannot write prepared weights %s (%s)", path, e)
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def load_model(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device = "cpu", *,
               load_format: str = "auto", seed: int = 0, quantization: str = "none") -> LlamaForCausalLM:
    """Build a :class:`LlamaForCausalLM` from an HF-style directory of safetensors.

    Args:
        load_format: ``auto`` reads ``*.safetensors``; ``dummy`` reads only ``config.json``
            and fills the weights with :func:`init_dummy_weights` (``seed``).
        quantization: ``none`` (default here), ``auto`` or ``gguf``: whether a model converted from a
            quantized GGUF runs its linears on the GGUF blocks (:mod:`tinyvllm.model.gguf_quant`,
            :func:`~tinyvllm.model.gguf_quant.resolve_quantization`). The dequantized prepared file is
            still what the embedding and norms map; the native linears' pages of it are never read.

    The weights are not packed for the CPU GEMM here: binding the C++ attention backend does that
    (:meth:`LlamaForCausalLM.bind_attn_backend`).

    Raises:
        ValueError: unsupported config or mismatched weights; unknown ``load_format``.
    """
    from tinyvllm.model import gguf_quant

    native = gguf_quant.resolve_quantization(quantization, model_dir, dtype, device, load_format)
    model = _load_dense(model_dir, dtype, device, load_format=load_format, seed=seed)
    if native is not None:
        nbytes = gguf_quant.attach_gguf_quant(model, native, strict=quantization == "gguf")
        if nbytes:
            logger.info("native GGUF weights (%s): %.1f MiB of quantized blocks", native.name, nbytes / 2**20)
    return model


def _load_dense(model_dir: str | Path, dtype: torch.dtype, device: str | torch.device, *, load_format: str,
                seed: int) -> LlamaForCausalLM:
    from safetensors import safe_open

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {load_format!r}")
    from tinyvllm.model.registry import config_from_dir

    model_dir = Path(model_dir)
    model_cls, cfg = config_from_dir(model_dir)
    with torch.device("meta"):  # no allocation, no initialisation (see llama.Embedding)
        model = model_cls(cfg)
    model = model.to(dtype)  # on meta: free; parameters are then allocated (or assigned) in ``dtype``
    files = sorted(model_dir.glob("*.safetensors"))
    prepared = None
    if load_format != "dummy" and sum(f.stat().st_size for f in files) >= PREPARED_MIN_BYTES:
        prepared = prepared_weights_path(model_dir, dtype)
        tensors = _load_prepared(*prepared, model.state_dict())
        if tensors is not None:
            if torch.device(device).type != "cpu":
                tensors = {k: v.to(device) for k, v in tensors.items()}
            model.load_state_dict(tensors, strict=True, assign=True)
            model.reset_rotaries(device)
            model.eval()
            return model

    def weights() -> Iterable[tuple[str, torch.Tensor]]:
        for f in files:
            with safe_open(str(f), framework="pt") as fh:
                for key in fh.keys():
                    yield key, fh.get_tensor(key)

    model = model.to_empty(device=device)
    model.reset_rotaries(device)  # buffers built on the meta device must be recomputed
    if load_format == "dummy":
        init_dummy_weights(model, seed)
    else:
        import time

        t0 = time.monotonic()
        if prepared is not None:  # a first run: the next start maps the prepared file instead
            logger.info("preparing the %s weights of %s (first run: converted to the model dtype and written "
                        "once) ...", str(dtype).replace("torch.", ""), model_dir.name)
        load_weights(model, weights())
        if prepared is not None and torch.device(device).type == "cpu":
            _save_prepared(*prepared, model, model_dir)
        if prepared is not None:
            logger.info("prepared the weights in %.1fs", time.monotonic() - t0)
    model.eval()
    return model
