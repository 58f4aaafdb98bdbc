"""The KV offload tier on the real model: greedy outputs are token-identical with the tier on and off
across pool evictions, preemptions and a restart of a disk tier; tier hits count as cached tokens;
different cache_salts never share a block; no KV block is owned afterwards."""

from __future__ import annotations

import random

import pytest

from tinyvllm import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)


def _check_no_leak(llm):
    core = llm.llm_engine.core
    assert core.stats()["kv_blocks_used"] == 0
    core.scheduler.kv.check_invariants()


def _sessions(llm, n_sessions=3, turns=3, tail=40, seed=3):
    """Round-robin agent sessions: each turn appends ``tail`` new tokens to the session's history
    (prompt + previous answers). Returns (outputs per turn, cached tokens per turn, prefill tokens)."""
    rng = random.Random(seed)
    hist = {s: [] for s in range(n_sessions)}
    toks, cached = [], []
    before = llm.stats()["prefill_tokens"]
    for _ in range(turns):
        for s in hist:
            hist[s] = hist[s] + [rng.randrange(100, 40000) for _ in range(tail)]
            o = llm.generate({"prompt_token_ids": hist[s]}, SP)[0]
            toks.append(o.outputs[0].token_ids)
            cached.append(o.num_cached_tokens)
            hist[s] = hist[s] + o.outputs[0].token_ids
    return toks, cached, llm.stats()["prefill_tokens"] - before


def test_host_tier_identical_outputs_across_pool_evictions(make_smol_llm):
    # 20 blocks x 16 = 320 token slots: one session's history at a time (3 sessions reach 132 tokens).
    off = make_smol_llm(num_kv_blocks=20)
    on = make_smol_llm(num_kv_blocks=20, kv_offload_size="64MiB")
    t_off, c_off, p_off = _sessions(off)
    t_on, c_on, p_on = _sessions(on)
    assert t_on == t_off
    st = on.stats()
    assert st["kv_offload_stored_blocks"] > 0 and st["kv_offload_loaded_blocks"] > 0
    # Tier hits are cached tokens: the last round finds each session's whole previous turn (84 tokens
    # known, 83 computed: 5 full blocks); without the tier the pool has evicted most of them.
    assert c_on[-3:] == [80, 80, 80] and c_off[-3:] != [80, 80, 80]
    assert st["prefix_cache_hits"] == sum(c_on) and st["kv_offload_hit_tokens"] > 0
    assert p_on < p_off and p_on == sum(len_ - c for len_, c in zip(_lens(), c_on))
    _check_no_leak(on)
    _check_no_leak(off)
    # The prefix-cache report (issue 18's prefix_cache_debug) splits the hit between pool and tier.
    sched, seen = on.llm_engine.core.scheduler, []
    add = sched.add_request

    def add_debug(req):
        req.prefix_cache_debug = True
        seen.append(req)
        add(req)

    sched.add_request = add_debug
    try:
        _sessions(on, turns=2)  # the same sessions again: the first turn's blocks were evicted to the tier
    finally:
        sched.add_request = add
    reports = [(r.prefix_cache_report, r.num_cached_tokens, r.num_cached_tokens_tier) for r in seen]
    assert any(tier > 0 for _, _, tier in reports)
    for rep, cached, tier in reports:
        assert rep.offloaded_tokens == tier and rep.cached_tokens + rep.offloaded_tokens == cached


def _lens(n_sessions=3, turns=3, tail=40):
    return [tail * (t + 1) + 4 * t for t in range(turns) for _ in range(n_sessions)]


def test_preemption_with_tier_resumes_identically(make_smol_llm):
    """A pool far too small for the batch: preempted requests come back through the pool or the tier
    (their full blocks), and every output equals the one computed in a pool that holds them all."""
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(rng.randrange(40, 120))]}
               for _ in range(6)]  # 6 x 16 tokens (8 x 24 before 2026-12-05): still ~3x what 16 blocks hold
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    alone = make_smol_llm()
    want = [o.outputs[0].token_ids for o in alone.generate(prompts, sp)]
    assert alone.stats()["num_preemptions"] == 0  # a pool that holds them all
    llm = make_smol_llm(num_kv_blocks=16, kv_offload_size="64MiB")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    assert got == want
    st = llm.stats()
    assert st["num_preemptions"] > 0
    _check_no_leak(llm)


def test_cache_salt_never_shares(make_smol_llm):
    llm = make_smol_llm(kv_offload_size="64MiB")
    rng = random.Random(5)
    p = {"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(50)]}
    a = llm.generate(p, SamplingParams(temperature=0, max_tokens=2, cache_salt="alice"))[0]
    b = llm.generate(p, SamplingParams(temperature=0, max_tokens=2, cache_salt="bob"))[0]
    c = llm.generate(p, SamplingParams(temperature=0, max_tokens=2))[0]
    d = llm.generate(p, SamplingParams(temperature=0, max_tokens=2, cache_salt="alice"))[0]
    assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens, d.num_cached_tokens) == (0, 0, 0, 48)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids == c.outputs[0].token_ids == d.outputs[0].token_ids
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")
    _check_no_leak(llm)


def test_disk_tier_survives_a_restart(make_smol_llm, tmp_path):
    rng = random.Random(7)
    turn1 = [rng.randrange(100, 40000) for _ in range(100)]
    a = make_smol_llm(kv_offload_size="32MiB", kv_offload_path=str(tmp_path))
    o1 = a.generate({"prompt_token_ids": turn1}, SP)[0]
    assert o1.num_cached_tokens == 0
    del a  # the first "server" goes away; its blocks were written when the request finished
    turn2 = turn1 + o1.outputs[0].token_ids + [rng.randrange(100, 40000) for _ in range(30)]
    b = make_smol_llm(kv_offload_size="32MiB", kv_offload_path=str(tmp_path))
    o2 = b.generate({"prompt_token_ids": turn2}, SP)[0]
    # Every full block of turn 1's prompt + answer (104 tokens: 6 blocks) comes from the disk.
    assert o2.num_cached_tokens == 96
    assert o2.num_cached_tokens_tier == 96  # all from the disk: the new engine's pool was empty
    assert b.stats()["kv_offload_hit_tokens"] == 96
    ref = make_smol_llm().generate({"prompt_token_ids": turn2}, SP)[0]
    assert o2.outputs[0].token_ids == ref.outputs[0].token_ids
    _check_no_leak(b)


def test_offload_config_errors(tmp_path):
    from tinyvllm.config import EngineConfig

    with pytest.raises(ValueError, match="kv_offload_path needs kv_offload_size"):
        EngineConfig.from_kwargs(kv_offload_path=str(tmp_path))
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig.from_kwargs(kv_offload_size="1GiB", enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_size: cannot parse"):
        EngineConfig.from_kwargs(kv_offload_size="lots")
    assert EngineConfig.from_kwargs(kv_offload_size="512MiB").cache_config.kv_offload_size == 512 << 20
    assert EngineConfig.from_kwargs(kv_offload_size="0").cache_config.kv_offload_size == 0
