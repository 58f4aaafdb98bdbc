"""bf16 fidelity of the embedded model against transformers (issue 37).

The references (``tests/data/bf16_fidelity.json``) are transformers' greedy outputs on the same GGUF, in
float32 and in bfloat16 (its default sdpa attention), for 24 chat prompts (greedy, 32 tokens, EOS
ignored), and float32's log-probability of each of its own tokens. They were made once by
``benchmarks/bf16_fidelity.py refs`` (the file records the machine and versions). The rule: tinyvllm's
bf16 is at least as close to float32 as transformers' bf16 is, by exact matches, by mean common
prefix, and by the mean error of the teacher-forced log-probabilities (a continuous figure: greedy
agreement alone is decided by near-ties). A kernel change that loses precision then fails here, not
in a user's first question.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tinyvllm import SamplingParams

REFS = json.loads((Path(__file__).parent / "data" / "bf16_fidelity.json").read_text())


def _score(got: list[list[int]]) -> tuple[int, float]:
    """(outputs equal to float32's, mean common-prefix length with float32's in tokens)."""
    prefixes = []
    for a, b in zip(REFS["float32"], got):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        prefixes.append(n)
    return sum(a == b for a, b in zip(REFS["float32"], got)), sum(prefixes) / len(prefixes)


def _logprob_error(llm) -> float:
    """Mean |logprob - float32's logprob| of float32's own continuation tokens, teacher-forced (nats)."""
    outs = llm.generate([{"prompt_token_ids": ids + c} for ids, c in zip(REFS["prompt_token_ids"], REFS["float32"])],
                        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    errs = []
    for ids, cont, ref, out in zip(REFS["prompt_token_ids"], REFS["float32"], REFS["float32_logprobs"], outs):
        errs += [abs(out.prompt_logprobs[len(ids) + i][t].logprob - r) for i, (t, r) in enumerate(zip(cont, ref))]
    return sum(errs) / len(errs)


def _check_at_least_as_close_as_transformers_bf16(llm) -> None:
    outs = llm.generate([{"prompt_token_ids": ids} for ids in REFS["prompt_token_ids"]],
                        SamplingParams(temperature=0, max_tokens=REFS["num_tokens"], ignore_eos=True))
    equal, prefix = _score([list(o.outputs[0].token_ids) for o in outs])
    hf_equal, hf_prefix = _score(REFS["bfloat16"])
    err, hf_err = _logprob_error(llm), REFS["bfloat16_logprob_error"]
    print(f"equal to float32: {equal} (transformers bf16 {hf_equal}) of {len(outs)}; mean prefix {prefix:.2f} "
          f"({hf_prefix:.2f}); logprob error {err:.4f} ({hf_err:.4f}) nats")
    assert equal >= hf_equal and prefix >= hf_prefix, (equal, hf_equal, prefix, hf_prefix)
    assert err <= hf_err, (err, hf_err)


def test_prompts_render_as_in_transformers(smol_llm):
    """The stored prompt ids are transformers' chat template of the stored prompts: tinyvllm renders the same."""
    assert [smol_llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}])
            for p in REFS["prompts"]] == REFS["prompt_token_ids"]


def test_default_bf16_is_at_least_as_close_to_float32_as_transformers_bf16(smol_llm):
    _check_at_least_as_close_as_transformers_bf16(smol_llm)


def test_native_gguf_bf16_activations_are_at_least_as_close_as_transformers_bf16(monkeypatch):
    """``--quantization gguf`` with bf16 activations against the same float32 references (transformers'
    float32 is the dequantized float32 model)."""
    from tinyvllm import LLM
    from tinyvllm.kernels.cpu import cpu_kernels
    from tinyvllm.model import gguf_quant

    if cpu_kernels() is None:
        pytest.skip("no C++ kernels: --quantization gguf cannot run here")
    monkeypatch.setenv("TINYVLLM_GGUF_ACTIVATIONS", "bf16")
    monkeypatch.setattr(gguf_quant, "_INT8_ACTS", {})
    llm = LLM("SmolLM2-135M-Instruct", dtype="bfloat16", quantization="gguf")
    try:
        _check_at_least_as_close_as_transformers_bf16(llm)
    finally:
        del llm
