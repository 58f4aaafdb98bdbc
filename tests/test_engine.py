"""Engine core on the real model: greedy outputs are identical whatever the batching, chunking,
block size, prefix-cache state or preemption history; no KV block is owned afterwards."""

from __future__ import annotations

import random

import pytest

from tinyvllm import SamplingParams

from conftest import CHAT_PROMPTS, assert_no_kv_leak

MAX_TOKENS = 16  # 24 before 2026-12-05 (the suite's time budget)
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)


def _prompts(llm, n=16):
    tok = llm.get_tokenizer()
    rng = random.Random(0)
    ids = [llm.llm_engine.chat_prompt_ids([{"role": "user", "content": p}]) for p in CHAT_PROMPTS]
    while len(ids) < n:  # plus random-token prompts of assorted lengths (some > 64 tokens)
        ids.append([rng.randrange(100, tok.vocab_size) for _ in range(rng.randrange(5, 150))])
    return [{"prompt_token_ids": p} for p in ids[:n]]


def _tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def prompts(smol_llm):
    return _prompts(smol_llm)


@pytest.fixture(scope="module")
def one_at_a_time(smol_llm, prompts):
    return [_tokens(smol_llm.generate(p, GREEDY))[0] for p in prompts]


def test_batched_equals_one_at_a_time(smol_llm, prompts, one_at_a_time):
    assert _tokens(smol_llm.generate(prompts, GREEDY)) == one_at_a_time
    assert_no_kv_leak(smol_llm)


@pytest.mark.parametrize("opts", [
    dict(max_num_batched_tokens=64),                      # heavy chunked prefill
    dict(enable_prefix_caching=False),
    dict(block_size=32),
    dict(max_num_seqs=3),
    dict(scheduling_policy="static", max_num_seqs=5),
], ids=["budget64", "no-prefix-cache", "block32", "max-seqs3", "static"])
def test_engine_options_do_not_change_outputs(make_smol_llm, prompts, one_at_a_time, opts):
    llm = make_smol_llm(**opts)
    assert _tokens(llm.generate(prompts, GREEDY)) == one_at_a_time
    assert_no_kv_leak(llm)


def test_preemption_resumes_with_identical_output(make_smol_llm, prompts, one_at_a_time):
    # 24 blocks x 16 tokens = 384 token slots: far less than 16 sequences need at once.
    llm = make_smol_llm(num_kv_blocks=24, enable_prefix_caching=False)
    assert _tokens(llm.generate(prompts, GREEDY)) == one_at_a_time
    assert llm.stats()["num_preemptions"] > 0
    assert_no_kv_leak(llm)


def test_prefix_cache_shared_system_prompt(make_smol_llm):
    llm_on = make_smol_llm(enable_prefix_caching=True)
    llm_off = make_smol_llm(enable_prefix_caching=False)
    tok = llm_on.get_tokenizer()
    rng = random.Random(1)
    system = [rng.randrange(100, tok.vocab_size) for _ in range(512)]
    prompts = [{"prompt_token_ids": system + [rng.randrange(100, tok.vocab_size) for _ in range(12 + i)]}
               for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    off = _tokens(llm_off.generate(prompts, sp))
    first = _tokens(llm_on.generate(prompts[:1], sp))
    outs = llm_on.generate(prompts[1:], sp)
    assert first + _tokens(outs) == off
    assert all(o.num_cached_tokens == 512 for o in outs)  # 32 full blocks of the system prompt
    assert llm_on.stats()["prefix_cache_hits"] >= 3 * 512
    assert_no_kv_leak(llm_on)
    assert_no_kv_leak(llm_off)


def test_prefix_cache_same_prompt_block_multiple(make_smol_llm):
    llm = make_smol_llm()
    tok = llm.get_tokenizer()
    rng = random.Random(2)
    prompt = {"prompt_token_ids": [rng.randrange(100, tok.vocab_size) for _ in range(64)]}  # 4 full blocks
    greedy24 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)  # the output fills a 5th block
    a = llm.generate(prompt, greedy24)[0]
    b = llm.generate(prompt, greedy24)[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.num_cached_tokens == 0
    assert b.num_cached_tokens == 48  # the last block is recomputed: the last prompt token needs logits
    # Blocks filled by generated tokens are reused too: resend prompt + output.
    c = llm.generate({"prompt_token_ids": prompt["prompt_token_ids"] + a.outputs[0].token_ids}, greedy24)[0]
    assert c.num_cached_tokens == 80  # 64 + 24 = 88 tokens known; 5 full blocks cached (88 // 16)
    assert_no_kv_leak(llm)


def test_agent_turns_prefill_tokens(make_smol_llm):
    """The seeds' expanding triangle: 7 turns, each appending a 64-token tail to the whole history."""
    tail, turns = 64, 7
    computed = {}
    for caching in (True, False):
        llm = make_smol_llm(enable_prefix_caching=caching)
        tok = llm.get_tokenizer()
        rng = random.Random(3)
        history: list[int] = []
        before = llm.stats()["prefill_tokens"]
        for _ in range(turns):
            history = history + [rng.randrange(100, tok.vocab_size) for _ in range(tail)]
            out = llm.generate({"prompt_token_ids": history}, SamplingParams(temperature=0, max_tokens=4,
                                                                               ignore_eos=True))[0]
            history = history + out.outputs[0].token_ids
        computed[caching] = llm.stats()["prefill_tokens"] - before
        assert_no_kv_leak(llm)
    # With caching: ~ one tail per turn (+ the partial last block and the previous answer's tokens).
    assert computed[True] <= turns * (tail + 16 + 4)
    # Without: the whole history every turn, 64 * (1 + 2 + ... + 7) = 28 tails (+ answers).
    assert computed[False] >= 28 * tail
    assert computed[False] / computed[True] > 3


def test_abort_frees_blocks(smol_llm):
    eng = smol_llm.llm_engine
    rid = eng.add_request("Tell me a long story.", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        eng.step()
    assert smol_llm.stats()["kv_blocks_used"] > 0
    eng.abort_request(rid)
    assert smol_llm.stats()["kv_blocks_used"] == 0
    assert not eng.has_unfinished_requests()


def test_idle_step_drops_finished_requests_in_the_worker(smol_llm):
    """The schedule that reports finished requests reaches the worker even when nothing else is scheduled,
    so the model runner keeps no state of finished requests (none at all once the engine is idle)."""
    from tinyvllm import SamplingParams

    smol_llm.generate(["Hello there", "One two three"], SamplingParams(temperature=0, max_tokens=3))
    core = smol_llm.llm_engine.core
    assert not core.has_unfinished_requests()
    core.step()  # idle: schedules nothing, but carries the last finishes
    assert core.runner.requests == {}


@pytest.mark.parametrize("mode", ["auto", "0", "1"])
def test_cpu_pool_runs_the_steps_its_mode_names(make_smol_llm, prompts, one_at_a_time, monkeypatch, mode):
    """TINYVLLM_CPU_POOL: ``auto`` (the default) runs the kernels' parallel loops on cpu_pool.h's pool
    in steps of exactly one token (batch-1 decode) and on at::parallel_for in larger ones (a prefill,
    a batched decode); ``1`` in every step, ``0`` in none. Greedy tokens are the same in every mode."""
    import torch

    if torch.get_num_threads() < 2:
        pytest.skip("one torch thread: neither the pool nor at::parallel_for starts a parallel job")
    monkeypatch.setenv("TINYVLLM_CPU_POOL", mode)
    llm = make_smol_llm()
    kern = llm.llm_engine.core.runner._pool_kern
    if kern is None:
        pytest.skip("no C++ CPU kernels: the pool does not exist")

    def pool_jobs(reqs, max_tokens):
        j0 = kern.parallel_pool_stats()[0]
        toks = _tokens(llm.generate(reqs, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)))
        return kern.parallel_pool_stats()[0] - j0, toks

    prefill_jobs, _ = pool_jobs(prompts[0], 1)               # one step: the prompt's prefill
    batch_jobs, _ = pool_jobs(prompts[:4], 3)                # prefills and decode steps of 4 rows
    decode_jobs, toks = pool_jobs(prompts[1], MAX_TOKENS)    # a prefill, then 23 batch-1 decode steps
    assert toks == [one_at_a_time[1]]
    if mode == "0":
        assert (prefill_jobs, batch_jobs, decode_jobs) == (0, 0, 0)
    elif mode == "1":
        assert prefill_jobs > 0 and batch_jobs > 0 and decode_jobs > 0
    else:
        assert prefill_jobs == 0 and batch_jobs == 0
        assert decode_jobs >= 23 * 30  # each decode step: at least one pool job per layer (30 layers)
    kern.set_parallel_pool(False)
