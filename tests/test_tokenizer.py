"""``load_tokenizer``'s per-process cache: one parse per model directory, and never a stale tokenizer."""

from __future__ import annotations

import os

from tinyvllm.engine.tokenizer import load_tokenizer
from tinyvllm.model.dummy import save_word_level_tokenizer


def test_a_directory_is_parsed_once_and_rewritten_files_are_loaded_again(tmp_path):
    save_word_level_tokenizer(tmp_path, 16)
    first = load_tokenizer(tmp_path)
    assert load_tokenizer(str(tmp_path)) is first and first.vocab_size == 16
    # the same directory written again with another vocabulary (sizes differ; mtimes may not, on a coarse clock)
    save_word_level_tokenizer(tmp_path, 40)
    again = load_tokenizer(tmp_path)
    assert again is not first and again.vocab_size == 40
    # the same bytes, touched: another key (an in-place edit may keep the size)
    st = os.stat(tmp_path / "tokenizer.json")
    os.utime(tmp_path / "tokenizer.json", ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
    assert load_tokenizer(tmp_path) is not again
