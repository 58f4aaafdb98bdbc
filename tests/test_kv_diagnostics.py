"""Prefix-break diagnostics and per-request KV cost in the scheduler (tinyvllm/core/kv_diagnostics.py),
driven by the fake runner of tests/test_scheduler.py and a scripted clock (no wall time)."""

from __future__ import annotations

import pytest

from test_scheduler import make_request, make_scheduler, run_to_completion, runner_of, toks
from tinyvllm.config import CacheConfig, SchedulerConfig
from tinyvllm.core.block_pool import BlockPool
from tinyvllm.core.kv_diagnostics import block_state_map, kv_block_share
from tinyvllm.core.scheduler import Scheduler
from tinyvllm.metrics.kv_stats import BLOCK_CACHED_FREE, BLOCK_FREE, BLOCK_OWNED


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def debug_request(rid, prompt, max_tokens=1):
    req = make_request(rid, prompt, max_tokens=max_tokens)
    req.prefix_cache_debug = True
    return req


def admit_and_finish(sched, req):
    sched.add_request(req)
    run_to_completion(sched)
    return req


# ---------------------------------------------------------------------------- prefix-break diagnostics

def test_third_block_changed_reports_prefix_changed_at_the_token():
    sched = make_scheduler(block_size=4, num_blocks=64)
    p1 = toks(1, 16)
    admit_and_finish(sched, debug_request("a", p1))
    p2 = list(p1)
    p2[9] = (p2[9] + 1) % 64  # block 2 (tokens 8..11), offset 1
    b = admit_and_finish(sched, debug_request("b", p2))
    r = b.prefix_cache_report
    assert (r.reason, r.matched_blocks, r.num_full_blocks, r.cached_tokens) == ("prefix_changed", 2, 4, 8)
    assert r.diverged_at_token == 9
    assert r.common_token_ids == p2[:9]
    assert r.new_token_ids == p2[9:]
    assert r.previous_token_ids[:7] == p1[9:]  # then the earlier request's output tokens
    assert sched.stats.prefix_cache_miss_reasons == {"cold": 1, "prefix_changed": 1}


def test_same_prompt_again_is_partial_last_block_and_new_prompt_is_cold():
    sched = make_scheduler(block_size=4, num_blocks=64)
    p = toks(2, 18)
    a = admit_and_finish(sched, debug_request("a", p))
    assert a.prefix_cache_report.reason == "cold" and a.prefix_cache_report.matched_blocks == 0
    b = admit_and_finish(sched, debug_request("b", p))
    assert b.prefix_cache_report.reason == "partial_last_block"
    assert b.prefix_cache_report.matched_blocks == 4 and b.num_cached_tokens == 16


@pytest.mark.parametrize("forget_chains", [False, True], ids=["chains", "evicted-hashes-only"])
def test_evicted_prefix_reports_evicted(forget_chains):
    # 8 blocks of 4 tokens. "a" (16 tokens) leaves 4 cached-free blocks; "c" (28 tokens, unrelated) needs 7
    # and evicts a's logical blocks 3, 2, 1 (freed tail first), keeping block 0 cached.
    sched = make_scheduler(block_size=4, num_blocks=8)
    p = toks(3, 16)
    admit_and_finish(sched, debug_request("a", p))
    admit_and_finish(sched, debug_request("c", toks(4, 28)))
    if forget_chains:  # the prompt record is bounded; the record of evicted hashes alone must suffice
        sched.prefix_diag.chains.clear()
    a2 = admit_and_finish(sched, debug_request("a2", p))
    r = a2.prefix_cache_report
    assert (r.reason, r.matched_blocks) == ("evicted", 1)
    assert sched.stats.prefix_cache_miss_reasons["evicted"] == 1


def test_no_report_without_debug_but_reason_counted():
    sched = make_scheduler(block_size=4, num_blocks=64)
    a = admit_and_finish(sched, make_request("a", toks(5, 12), max_tokens=1))
    assert a.prefix_cache_report is None
    assert sched.make_stats().prefix_cache_miss_reasons == {"cold": 1}


def test_report_says_disabled_without_prefix_caching():
    sched = make_scheduler(block_size=4, num_blocks=64, prefix_caching=False)
    a = admit_and_finish(sched, debug_request("a", toks(6, 12)))
    assert a.prefix_cache_report.reason == "disabled"


# ---------------------------------------------------------------------------- KV cost

def test_kv_block_seconds_matches_a_hand_computation():
    """Block size 4; "a" and "b" share an 8-token prompt; the clock is scripted per call.

    t=0   schedule 1: a admitted, 8 tokens -> 2 blocks
    t=1   update 1:   a holds 2 blocks for 1 s                      a = 2
    t=3   schedule 2: a 2 blocks for 2 s (a = 6); a grows to 3 blocks; b hits a's block 0 (shared by 2)
                      and takes 1 new block
    t=3.5 update 2:   a: 1/2 + 1 + 1 = 2.5 blocks x 0.5 s (a = 7.25); b: 1/2 + 1 = 1.5 x 0.5 (b = 0.75);
                      b finishes (max_tokens 1) and frees its blocks
    t=4   schedule 3: a alone, 3 blocks x 0.5 s                      a = 8.75
    t=6   update 3:   3 blocks x 2 s                                 a = 14.75; a finishes
    """
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16),
                      CacheConfig(block_size=4, enable_prefix_caching=True), 64, 4096, clock=clock)
    runner = runner_of(sched)
    prompt = toks(7, 8)
    a = make_request("a", prompt, max_tokens=3)
    b = make_request("b", prompt, max_tokens=1)
    sched.add_request(a)

    def step(t_schedule, t_update):
        clock.t = t_schedule
        out = sched.schedule()
        sampled = runner.execute(out)
        clock.t = t_update
        sched.update_from_output(out, sampled)
        return out

    step(0.0, 1.0)
    sched.add_request(b)
    step(3.0, 3.5)
    assert b.status.is_finished and b.num_cached_tokens == 4
    step(4.0, 6.0)
    assert a.status.is_finished
    assert a.kv_block_seconds == pytest.approx(14.75)
    assert b.kv_block_seconds == pytest.approx(0.75)
    assert sched.stats.kv_block_seconds == pytest.approx(15.5)
    assert (a.peak_num_blocks, b.peak_num_blocks) == (3, 2)
    assert (a.num_prefill_computed, a.num_prefill_cached) == (8, 0)
    assert (b.num_prefill_computed, b.num_prefill_cached) == (4, 4)
    sched.kv.check_invariants()


def test_kv_cost_of_an_aborted_request_stops_at_the_abort():
    clock = Clock()
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=16),
                      CacheConfig(block_size=4, enable_prefix_caching=True), 64, 4096, clock=clock)
    a = make_request("a", toks(8, 8), max_tokens=10)
    sched.add_request(a)
    out = sched.schedule()  # t=0: 2 blocks
    clock.t = 1.0
    sched.update_from_output(out, runner_of(sched).execute(out))
    clock.t = 1.5
    sched.abort_requests(["a"])
    clock.t = 100.0
    sched.schedule()
    assert a.kv_block_seconds == pytest.approx(3.0)


def test_preempted_gauge_counts_waiting_preempted_requests():
    sched = make_scheduler(block_size=4, num_blocks=6, budget=64)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", toks(10 + i, 8), max_tokens=8))
    seen = []
    run_to_completion(sched, on_step=lambda out: seen.append(sched.num_preempted_waiting))
    assert sched.stats.num_preemptions > 0 and max(seen) > 0
    assert sched.num_preempted_waiting == 0


def test_block_share_and_block_map():
    pool = BlockPool(4)
    a = pool.get_new_blocks(2)
    pool.touch([a[0]])  # a[0] shared by two holders
    assert kv_block_share(a) == pytest.approx(1.5)
    pool.cache_full_block(a[1], 123)
    pool.free_blocks([a[1]])
    assert list(block_state_map(pool)) == [BLOCK_OWNED, BLOCK_CACHED_FREE, BLOCK_FREE, BLOCK_FREE]
