"""``prompt_logprobs`` (computed from the prefill's logits) against transformers on the same GGUF, float32,
with chunked prefill and a warm prefix cache; and ``logit_bias`` in the sampler path."""

from __future__ import annotations

import pytest
import torch

from tinyvllm.sampling_params import SamplingParams

PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and Berlin is the "
          "capital of Germany. One, two, three, four, five, six, seven, eight.")


@pytest.fixture(scope="module")
def fp32_llm(smol_llm_fp32):
    return smol_llm_fp32  # loaded once per session (tests/conftest.py)


@pytest.fixture(scope="module")
def hf_prompt_logprobs(fp32_llm, hf_smol_fp32):
    """transformers' log-softmax over the whole prompt: [P-1] logprob of each next prompt token, and top-3."""
    hf = hf_smol_fp32
    ids = fp32_llm.get_tokenizer()(PROMPT)["input_ids"]
    with torch.no_grad():
        lp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)  # [P, V]
    target = lp[:-1].gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    return ids, target.tolist(), lp[:-1].topk(3).indices.tolist()


def _check(out, ids, ref, ref_top):
    plp = out.prompt_logprobs
    assert plp is not None and len(plp) == len(ids) and plp[0] is None
    for i in range(1, len(ids)):
        entry = plp[i]
        assert ids[i] in entry, i
        assert abs(entry[ids[i]].logprob - ref[i - 1]) < 2e-3, (i, entry[ids[i]].logprob, ref[i - 1])
        top = sorted((v.rank, t) for t, v in entry.items() if v.rank is not None and v.rank <= 3)
        assert len(top) >= 3
        # the top-3 agree with HF except at near-ties
        assert top[0][1] == ref_top[i - 1][0] or abs(entry[top[0][1]].logprob - entry.get(
            ref_top[i - 1][0], entry[top[0][1]]).logprob) < 1e-3


@pytest.mark.parametrize("engine_kwargs", [
    {},                                                    # one prefill
    {"max_num_batched_tokens": 16, "block_size": 8},       # chunked prefill: logprobs gathered across chunks
], ids=["whole", "chunked"])
def test_prompt_logprobs_match_transformers_with_chunking_and_prefix_cache(fp32_llm, hf_prompt_logprobs,
                                                                            engine_kwargs):
    from tinyvllm import LLM

    ids, ref, ref_top = hf_prompt_logprobs
    llm = LLM("SmolLM2-135M-Instruct", dtype="float32", _preloaded_model=fp32_llm.llm_engine.core.model,
              **engine_kwargs)
    warm = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2))[0]
    assert warm.prompt_logprobs is None  # not asked for
    # The prefix cache now holds the prompt's blocks: a prompt_logprobs request must still score every token.
    for _ in range(2):
        out = llm.generate([{"prompt_token_ids": ids}],
                           SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=3, logprobs=1))[0]
        _check(out, ids, ref, ref_top)
        assert out.outputs[0].token_ids[:2] == warm.outputs[0].token_ids  # greedy unchanged
    # n > 1: every sample's request carries the same prompt logprobs
    outs = llm.generate([{"prompt_token_ids": ids}], SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=2,
                                                                   prompt_logprobs=0))[0]
    assert len(outs.prompt_logprobs) == len(ids)
    assert abs(outs.prompt_logprobs[5][ids[5]].logprob - ref[4]) < 2e-3


def test_logit_bias(fp32_llm):
    ids = fp32_llm.get_tokenizer()(PROMPT)["input_ids"]
    base = fp32_llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=4))[0]
    first = base.outputs[0].token_ids[0]
    forced = fp32_llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(temperature=0, max_tokens=4, logit_bias={1234: 100.0}))[0]
    assert forced.outputs[0].token_ids == [1234] * 4
    banned = fp32_llm.generate([{"prompt_token_ids": ids}],
                               SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100.0}))[0]
    assert first not in banned.outputs[0].token_ids
    # a zero bias changes nothing
    same = fp32_llm.generate([{"prompt_token_ids": ids}],
                             SamplingParams(temperature=0, max_tokens=4, logit_bias={first: 0.0}))[0]
    assert same.outputs[0].token_ids == base.outputs[0].token_ids
    for bad in ({5: 101.0}, {-1: 1.0}, {"x": 1.0}, {5: float("nan")}):
        with pytest.raises(ValueError, match="^logit_bias"):
            SamplingParams(logit_bias=bad)
    with pytest.raises(ValueError, match="logit_bias"):
        fp32_llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, logit_bias={10**7: 1.0}))
