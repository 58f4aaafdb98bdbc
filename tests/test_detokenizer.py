"""Incremental detokenization: UTF-8 safety and stop-string hold-back."""

from __future__ import annotations

import pytest

from tinyvllm import SamplingParams
from tinyvllm.engine.output_processor import IncrementalDetokenizer


@pytest.fixture(scope="module")
def tokenizer():
    from tinyvllm.engine.tokenizer import load_tokenizer
    from tinyvllm.model.loader import resolve_model

    return load_tokenizer(resolve_model("SmolLM2-135M-Instruct").model_dir)


TEXTS = ["Hello 😀 world 🎉🎉", "日本語のテキストです。", "naïve café — «quotes» ∑∫√", "mixed 中文 and emoji 👩‍👩‍👧"]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_pieces_are_whole_characters(tokenizer, text):
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer("Say:", add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, prompt, SamplingParams())
    pieces = []
    for t in ids:
        d.add_tokens([t])
        piece = d.delta(finished=False)
        assert "\ufffd" not in piece
        pieces.append(piece)
    pieces.append(d.delta(finished=True))
    assert "".join(pieces) == tokenizer.decode(ids)
    # Some character really is split across tokens (else the test proves nothing): a naive decode of the
    # ids so far ends in U+FFFD (half a UTF-8 sequence) at these positions, where the detokenizer held back.
    naive_splits = [i for i in range(len(ids)) if "\ufffd" in tokenizer.decode(ids[:i + 1])]
    assert naive_splits, f"no token of {text!r} ends inside a character"


def test_stop_string_never_partially_sent(tokenizer):
    text = "The answer is 42. END OF STORY and more text"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    d = IncrementalDetokenizer(tokenizer, [], SamplingParams(stop=["END OF"]))
    sent = ""
    for t in ids:
        hit = d.add_tokens([t])
        sent += d.delta(finished=hit is not None)
        assert "END" not in sent and not sent.endswith("E")
        if hit:
            break
    assert hit == "END OF"
    assert sent == "The answer is 42. "


def test_tokenizer_loads_like_autotokenizer(tokenizer):
    """load_tokenizer picks the declared class directly (no AutoConfig import); same ids and template."""
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    assert type(ref) is type(tokenizer)
    for s in ["hello world", " Paris.\n\nThe", "日本語 🎉", "<|im_start|>user\nhi<|im_end|>"]:
        assert ref(s)["input_ids"] == tokenizer(s)["input_ids"]
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo?"}]
    assert ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == \
        tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert (ref.eos_token_id, ref.bos_token_id) == (tokenizer.eos_token_id, tokenizer.bos_token_id)


def test_model_specific_tokenizer_class_goes_through_autotokenizer(tokenizer, tmp_path):
    """A declared model-specific class (here LlamaTokenizerFast over SmolLM2's byte-level
    tokenizer.json) must not be loaded directly: AutoTokenizer picks the right backend."""
    import json
    import shutil
    from pathlib import Path

    from transformers import AutoTokenizer

    from tinyvllm.engine.tokenizer import load_tokenizer

    src = Path(tokenizer.name_or_path)
    for f in src.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja") or f.name == "config.json":
            shutil.copy(f, tmp_path / f.name)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["tokenizer_class"] = "LlamaTokenizerFast"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours, ref = load_tokenizer(tmp_path), AutoTokenizer.from_pretrained(str(tmp_path))
    text = "Hello world, 日本語 🎉 what's up?"
    assert ours(text)["input_ids"] == ref(text)["input_ids"] == tokenizer(text)["input_ids"]


def _slow_decode(tokenizer, ids: list[int]) -> str:
    """Reference: Hugging Face's slow-tokenizer join (PreTrainedTokenizer._decode with
    spaces_between_special_tokens=True): runs of ordinary tokens decode together, each
    added token is its own segment, segments joined with one space."""
    added = set(tokenizer.added_tokens_decoder)
    segs, run = [], []
    for t in ids:
        if t in added:
            if run:
                segs.append(tokenizer.decode(run))
                run = []
            segs.append(tokenizer.decode([t], skip_special_tokens=False))
        else:
            run.append(t)
    if run:
        segs.append(tokenizer.decode(run))
    return " ".join(segs)


@pytest.mark.parametrize("spaces", [True, False])
def test_spaces_between_special_tokens(tokenizer, spaces):
    msgs = [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! ok"}]
    text = tokenizer.apply_chat_template(msgs, tokenize=False)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert sum(t in tokenizer.added_tokens_decoder for t in ids) >= 4  # the test needs special tokens
    params = SamplingParams(skip_special_tokens=False, spaces_between_special_tokens=spaces)
    d = IncrementalDetokenizer(tokenizer, [], params)
    d.add_tokens(ids)
    plain = tokenizer.decode(ids, skip_special_tokens=False)
    assert d.text == (_slow_decode(tokenizer, ids) if spaces else plain)
    assert d.text != plain if spaces else "<|im_end|>\n<|im_start|>" in d.text
    # With special tokens skipped there is nothing to space out.
    d2 = IncrementalDetokenizer(tokenizer, [], SamplingParams(spaces_between_special_tokens=True))
    d2.add_tokens(ids)
    assert d2.text == tokenizer.decode(ids, skip_special_tokens=True)
