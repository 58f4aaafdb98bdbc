"""Tokenizer and chat template (Hugging Face ``transformers``), loaded from the model directory."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


# The tokenizers this process loaded, by directory and the identity of its files (see _files_key), most
# recently used last. A process that builds several engines over one model (the offline ``LLM`` made again
# with other options; an engine and its structured-output backend) parses tokenizer.json once: 0.2-0.25 s
# per load for SmolLM2's 49K vocabulary, measured. Bounded, so a long-lived process holds a few at most.
_CACHE: OrderedDict[tuple, PreTrainedTokenizerBase] = OrderedDict()
_CACHE_SIZE = 4
_CACHE_LOCK = threading.Lock()


def load_tokenizer(model_dir: str | Path) -> PreTrainedTokenizerBase:
    """Load the fast tokenizer (and its chat template) saved beside the weights.

    The tokenizer is shared: a later call for the same directory, while its files are unchanged (name,
    size, mtime), returns the same object, so callers treat it as read-only (tinyvllm never mutates one).

    Raises:
        ValueError: the directory has no usable tokenizer files.
    """
    key = _files_key(Path(model_dir))
    with _CACHE_LOCK:
        tok = _CACHE.get(key)
        if tok is not None:
            _CACHE.move_to_end(key)
            return tok
    tok = _load_tokenizer(Path(model_dir))
    with _CACHE_LOCK:
        _CACHE[key] = tok
        while len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return tok


def _files_key(model_dir: Path) -> tuple:
    """``(resolved directory, ((name, size, mtime_ns), ...))`` over the directory's files: a file written
    again, added or removed gives another key (one ``scandir``, microseconds)."""
    try:
        stats = [(e.name, e.stat()) for e in os.scandir(model_dir) if e.is_file()]
        files = tuple(sorted((name, st.st_size, st.st_mtime_ns) for name, st in stats))
    except OSError:
        files = ()
    return str(model_dir.resolve()), files


def _load_tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    cls = _declared_tokenizer_class(model_dir)
    if cls is not None:
        try:
            return cls.from_pretrained(str(model_dir))
        except Exception:  # pragma: no cover - let AutoTokenizer decide (and report)
            pass
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except Exception as e:  # pragma: no cover - depends on the directory
        raise ValueError(f"cannot load a tokenizer from {str(model_dir)!r}: {e}") from e


# Classes that only wrap ``tokenizer.json`` (no model-specific pre-tokenizer logic), so loading
# them directly gives what AutoTokenizer gives. Model-specific classes go through AutoTokenizer,
# which may deliberately load a different class (e.g. a declared LlamaTokenizerFast over a
# byte-level tokenizer.json becomes TokenizersBackend in transformers 5).
_GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _declared_tokenizer_class(model_dir: Path) -> Any:
    """The generic tokenizer class named by ``tokenizer_config.json``, or None (then AutoTokenizer).

    ``AutoTokenizer`` would first load the model's config through ``AutoConfig``, which imports the
    whole ``transformers.models.<arch>`` package (1.5 s of the server's start-up, measured); a
    generic tokenizer only needs its own class. The class is taken from the ``transformers`` package
    (a lazy attribute: only its module is imported), not through ``transformers.models.auto``, whose
    ``configuration_utils`` imports torch (1.1 s of the API process's start-up, which needs no torch).
    """
    import json

    try:
        name = json.loads((model_dir / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if name not in _GENERIC_TOKENIZER_CLASSES:
        return None
    import transformers

    return getattr(transformers, name, None)


def eos_token_ids(tokenizer: PreTrainedTokenizerBase, model_config: Any = None) -> list[int]:
    """EOS ids: the tokenizer's EOS plus the model config's ``eos_token_id`` (int or list)."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    eos = getattr(model_config, "eos_token_id", None) if model_config is not None else None
    if isinstance(eos, int):
        ids.add(eos)
    elif isinstance(eos, (list, tuple)):
        ids.update(int(x) for x in eos)
    return sorted(ids)


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, Any]],
                        add_generation_prompt: bool = True, **kwargs: Any) -> list[int]:
    """Render ``messages`` with the model's chat template and tokenize.

    ``content`` may be a string or a list of ``{"type": "text", "text": ...}`` parts.

    Raises:
        ValueError: malformed messages or a tokenizer without a chat template.
    """
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
        content = m.get("content", "")
        if isinstance(content, list):
            parts = []
            for p in content:
                if isinstance(p, dict) and p.get("type") == "text":
                    parts.append(str(p.get("text", "")))
                else:
                    raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        norm.append({**m, "content": content})
    if tokenizer.chat_template is None and kwargs.get("chat_template") is None:
        raise ValueError("this model's tokenizer has no chat template; use a completion prompt")
    text = tokenizer.apply_chat_template(norm, tokenize=False, add_generation_prompt=add_generation_prompt,
                                         **kwargs)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
