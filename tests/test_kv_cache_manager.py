"""Tests of the KV-cache manager and prefix caching (tinyvllm/core/kv_cache_manager.py)."""

import pytest
from hypothesis import event, given, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition,
                                 rule)

from tinyvllm.core.kv_cache_manager import KVCacheManager, PrefixCacheStats, hash_block_tokens

BS = 16


def toks(start, n):
    return list(range(start, start + n))


def prefill(kv, rid, tokens):
    """Schedule a whole prompt at once, using prefix-cache hits; return (hit tokens, new blocks)."""
    hit_blocks, num_hit = kv.get_computed_blocks(rid, tokens)
    new = kv.allocate_slots(rid, tokens, num_hit, len(tokens) - num_hit, hit_blocks)
    assert new is not None
    kv.check_invariants()
    return num_hit, new


def decode(kv, rid, tokens, new_token):
    """Append one sampled token and compute it (tokens[-1] was computed last step)."""
    tokens.append(new_token)
    assert kv.allocate_slots(rid, tokens, len(tokens) - 1, 1) is not None
    kv.check_invariants()


def snapshot(kv):
    pool = kv.block_pool
    return (
        [(b.ref_cnt, b.block_hash) for b in pool.blocks],
        [b.block_id for b in pool.free_block_queue],
        {h: b.block_id for h, b in pool.cached_block_hash_to_block.items()},
        {r: [b.block_id for b in bl] for r, bl in kv.req_to_blocks.items()},
        {r: list(h) for r, h in kv.req_to_block_hashes.items()},
        dict(kv.num_cached_blocks),
    )


# -- hashing -----------------------------------------------------------------

def test_hash_is_chained_and_deterministic():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, (1, 2, 3))
    assert isinstance(a, int) and 0 <= a < 2 ** 128
    assert a != hash_block_tokens(None, [1, 2, 4])
    assert a != hash_block_tokens(None, [3, 2, 1])
    b = hash_block_tokens(a, [4, 5, 6])
    assert b != hash_block_tokens(None, [4, 5, 6])  # depends on the parent
    assert b != hash_block_tokens(hash_block_tokens(None, [1, 2, 0]), [4, 5, 6])
    assert hash_block_tokens(None, [1], extra="lora-1") != hash_block_tokens(None, [1])
    assert hash_block_tokens(0, [1]) != hash_block_tokens(None, [1])
    assert hash_block_tokens(None, [1, 2, 3]) == a


_HASH_CHAIN_SRC = """
from tinyvllm.core.kv_cache_manager import hash_block_tokens
h = None
for i, extra in enumerate([None, "salt-A", ("lora", "x"), None]):
    h = hash_block_tokens(h, [i, 2**40 + i, -i, 49151], extra=extra)
    print(h)
"""


def test_hash_is_the_same_in_other_processes():
    """The hash keys the offload tier's files and a restarted server's cache: another interpreter, with
    another ``PYTHONHASHSEED`` (which changes Python's ``hash`` of str), computes the same chain."""
    import os
    import subprocess
    import sys

    here = subprocess.run([sys.executable, "-c", _HASH_CHAIN_SRC], capture_output=True, text=True, check=True,
                          env=dict(os.environ, PYTHONHASHSEED="1")).stdout.split()
    other = subprocess.run([sys.executable, "-c", _HASH_CHAIN_SRC], capture_output=True, text=True, check=True,
                           env=dict(os.environ, PYTHONHASHSEED="2")).stdout.split()
    h, mine = None, []
    for i, extra in enumerate([None, "salt-A", ("lora", "x"), None]):
        h = hash_block_tokens(h, [i, 2**40 + i, -i, 49151], extra=extra)
        mine.append(str(h))
    assert len(mine) == 4 and len(set(mine)) == 4
    assert here == other == mine


# -- allocation --------------------------------------------------------------

def test_allocate_grows_block_table_on_demand():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_caching=False)
    t = toks(0, 6)
    new = kv.allocate_slots("a", t, 0, 6)
    assert [b.block_id for b in new] == [0, 1]
    assert kv.get_block_ids("a") == [0, 1]
    t.append(9)
    assert kv.allocate_slots("a", t, 6, 1) == []  # token 6 fits in block 1
    t.append(10)
    assert kv.allocate_slots("a", t, 7, 1) == []  # token 7 fills block 1
    t.append(11)
    assert len(kv.allocate_slots("a", t, 8, 1)) == 1  # token 8 needs block 2
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.num_owned_blocks() == 3 and kv.get_num_free_blocks() == 5
    assert kv.usage == pytest.approx(3 / 8)
    assert kv.get_computed_blocks("b", t) == ([], 0)  # caching disabled
    assert kv.block_pool.cached_block_hash_to_block == {}
    kv.free("a")
    kv.free("a")  # idempotent
    kv.free("never-seen")
    assert kv.num_owned_blocks() == 0 and kv.get_block_ids("a") == []
    kv.check_invariants()


def test_bad_arguments():
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)
    with pytest.raises(ValueError):
        KVCacheManager(0, 4)
    kv = KVCacheManager(4, 4)
    with pytest.raises(ValueError):
        kv.allocate_slots("a", [1], 0, -1)


def test_allocation_failure_changes_nothing():
    kv = KVCacheManager(num_blocks=3, block_size=4)
    t = toks(0, 12)
    prefill(kv, "a", t)
    kv.free("a")  # 3 free blocks, all cached
    t2 = t + [99]
    hit_blocks, num_hit = kv.get_computed_blocks("b", t2)
    assert num_hit == 12
    before = snapshot(kv)
    # Needs the 3 cached blocks (reviving them empties the pool) + 1 new block.
    assert kv.allocate_slots("b", t2, num_hit, 1, hit_blocks) is None
    assert snapshot(kv) == before
    kv.check_invariants()
    # Without the hits the request fits in the three blocks... minus one short.
    assert kv.allocate_slots("b", t2, 0, 13) is None
    assert snapshot(kv) == before
    new = kv.allocate_slots("b", t2, 0, 12)
    assert len(new) == 3
    kv.check_invariants()


# -- prefix caching ----------------------------------------------------------

def test_second_request_hits_full_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = toks(1000, 40)  # 2 full blocks + 8 tokens
    assert prefill(kv, "a", prompt)[0] == 0
    a_ids = kv.get_block_ids("a")
    assert len(a_ids) == 3
    num_hit, new = prefill(kv, "b", list(prompt))
    assert num_hit == 32
    b_ids = kv.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2] and b_ids[2] != a_ids[2]
    assert [b.block_id for b in new] == b_ids[2:]
    assert [kv.block_pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]
    assert kv.prefix_cache_queries == 80 and kv.prefix_cache_hits == 32
    stats = kv.take_stats()
    assert stats == PrefixCacheStats(requests=2, queries=80, hits=32, reset=False)
    assert stats.hit_rate == pytest.approx(0.4)
    assert kv.take_stats() == PrefixCacheStats()
    assert kv.prefix_cache_hits == 32  # cumulative counters remain


def test_exact_multiple_leaves_last_token_to_compute():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    prompt = toks(0, 32)
    prefill(kv, "a", prompt)
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    num_hit, _ = prefill(kv, "b", list(prompt))
    assert num_hit == 16
    # A single-block prompt gets no hit at all.
    kv2 = KVCacheManager(num_blocks=4, block_size=BS)
    prefill(kv2, "a", toks(0, 16))
    assert kv2.get_computed_blocks("b", toks(0, 16)) == ([], 0)


def test_generated_tokens_become_hits():
    kv = KVCacheManager(num_blocks=10, block_size=BS)
    t = toks(0, 20)
    prefill(kv, "a", t)
    assert len(kv.block_pool.cached_block_hash_to_block) == 1
    for tok in range(500, 512):  # grows the sequence to 32 tokens
        decode(kv, "a", t, tok)
    assert len(t) == 32
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    num_hit, _ = prefill(kv, "b", t + [7, 7, 7])
    assert num_hit == 32
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]


def test_only_computed_tokens_are_cached():
    """A block is registered only once its tokens are scheduled, not when merely known."""
    kv = KVCacheManager(num_blocks=10, block_size=4)
    t = toks(0, 10)
    kv.get_computed_blocks("a", t)
    kv.allocate_slots("a", t, 0, 3)  # chunked prefill: no block full yet
    assert kv.block_pool.cached_block_hash_to_block == {}
    kv.allocate_slots("a", t, 3, 6)  # 9 tokens: 2 full blocks
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    # Scheduling beyond the known tokens (e.g. lookahead) caches only known ones.
    kv.allocate_slots("a", t, 9, 4)  # 13 slots, only 10 tokens known
    assert len(kv.block_pool.cached_block_hash_to_block) == 2
    assert len(kv.get_block_ids("a")) == 4
    kv.check_invariants()


def test_hashes_are_kept_incrementally(monkeypatch):
    import tinyvllm.core.kv_cache_manager as m
    calls = []
    real = m.hash_block_tokens
    monkeypatch.setattr(m, "hash_block_tokens", lambda *a, **k: calls.append(1) or real(*a, **k))
    kv = KVCacheManager(num_blocks=40, block_size=2)
    t = toks(0, 5)
    prefill(kv, "a", t)
    assert len(calls) == 2
    for tok in range(50):
        decode(kv, "a", t, tok)
    assert len(calls) == len(t) // 2  # each full block hashed exactly once


def test_different_first_block_breaks_chain():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    common_tail = toks(100, 32)
    prefill(kv, "a", toks(0, 16) + common_tail + [1])
    num_hit, _ = prefill(kv, "b", toks(50, 16) + common_tail + [1])
    assert num_hit == 0
    # Same first block, different second block: only the first block hits.
    num_hit, _ = prefill(kv, "c", toks(0, 16) + toks(300, 16) + common_tail[16:] + [1])
    assert num_hit == 16


def test_freed_content_hittable_until_evicted():
    kv = KVCacheManager(num_blocks=4, block_size=4)
    shared = toks(0, 8)
    prefill(kv, "a", shared + [42])  # blocks: 2 full (cached) + 1 partial
    kv.free("a")
    assert kv.num_owned_blocks() == 0
    num_hit, _ = prefill(kv, "b", shared + [43, 44])
    assert num_hit == 8  # served from free blocks
    b_ids = kv.get_block_ids("b")
    assert b_ids == [0, 1, 3]  # hits 0, 1 from a; a's partial block 2 is not reused
    kv.free("b")
    # b's blocks were freed tail first: a's partial block 2 is evicted first,
    # then b's partial block, then the second shared block, the first one last.
    assert [b.block_id for b in kv.block_pool.free_block_queue] == [2, 3, 1, 0]
    prefill(kv, "c", toks(900, 8))  # takes 2 blocks: evicts nothing shared
    assert kv.get_computed_blocks("d", shared + [1])[1] == 8
    kv.free("d")
    prefill(kv, "e", toks(700, 4))  # evicts the second shared block
    assert kv.get_computed_blocks("f", shared + [1])[1] == 4
    kv.free("f")
    kv.check_invariants()


def test_preempted_request_resumes_from_its_own_blocks():
    kv = KVCacheManager(num_blocks=10, block_size=4)
    t = toks(0, 6)
    prefill(kv, "a", t)
    for tok in range(3):
        decode(kv, "a", t, tok)  # 9 tokens, 2 full blocks
    kv.free("a")  # preemption
    hit_blocks, num_hit = kv.get_computed_blocks("a", t)
    assert num_hit == 8
    assert kv.allocate_slots("a", t, num_hit, len(t) - num_hit, hit_blocks) is not None
    kv.check_invariants()


def test_stale_computed_blocks_rejected():
    kv = KVCacheManager(num_blocks=3, block_size=2)
    prefill(kv, "a", [1, 2, 3])
    kv.free("a")
    hit_blocks, n = kv.get_computed_blocks("b", [1, 2, 3])
    assert n == 2
    prefill(kv, "c", [5, 6, 7, 8, 9])  # takes all 3 blocks: evicts the hit
    kv.free("c")
    with pytest.raises(ValueError):
        kv.allocate_slots("b", [1, 2, 3], n, 1, hit_blocks)
    kv.check_invariants()
    prefill(kv, "d", [1, 2, 3, 4, 5])
    with pytest.raises(ValueError):  # computed blocks only on first allocation
        kv.allocate_slots("d", [1, 2, 3, 4, 5], 5, 0, kv.get_blocks("d")[:1])


def test_reset_prefix_cache_and_stats():
    kv = KVCacheManager(num_blocks=4, block_size=2)
    prefill(kv, "a", [1, 2, 3])
    assert not kv.reset_prefix_cache()
    kv.free("a")
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks("b", [1, 2, 3]) == ([], 0)
    assert kv.take_stats().reset


def test_duplicate_content_in_flight_stays_consistent():
    """Two requests computing the same block concurrently: one mapping survives."""
    kv = KVCacheManager(num_blocks=6, block_size=2)
    t = [1, 2, 3]
    kv.get_computed_blocks("a", t)
    kv.get_computed_blocks("b", t)  # looked up before a registered anything
    kv.allocate_slots("a", t, 0, 3)
    kv.allocate_slots("b", t, 0, 3)
    a0, b0 = kv.get_blocks("a")[0], kv.get_blocks("b")[0]
    assert a0 is not b0
    assert kv.block_pool.get_cached_block(a0.block_hash) is a0 and b0.block_hash is None
    kv.free("a")
    kv.free("b")
    kv.check_invariants()


# -- stateful property test --------------------------------------------------

VOCAB = 3  # a tiny vocabulary makes prefixes collide often
SYSTEM_PROMPT = [1, 0, 2, 2, 1, 0, 0, 1, 2, 0, 1, 1]


class KVCacheMachine(RuleBasedStateMachine):
    """Simulates a scheduler over random requests and checks the manager against a model.

    The model tracks each request's known tokens, computed length and block table,
    and a shadow KV cache ``kv_content[block_id][offset] = token`` written only
    when the simulated model runner computes tokens.  Checked after every step:
    the manager's invariants; reference counts equal the model's holders; every
    running request's computed tokens are in its blocks (so prefix hits returned
    the right content and no shared block was ever overwritten); every cached
    hash maps to a block holding exactly the tokens of that hash.
    """

    @initialize(num_blocks=st.integers(1, 16), block_size=st.sampled_from([1, 2, 3, 4]),
                caching=st.sampled_from([True, True, True, False]))
    def setup(self, num_blocks, block_size, caching):
        self.kv = KVCacheManager(num_blocks, block_size, caching)
        self.bs = block_size
        self.reqs = {}  # rid -> {"tokens": [...], "computed": int, "running": bool}
        self.kv_content = {}  # block_id -> list of tokens (None = never written)
        self.prefix_of_hash = {}  # hash -> token tuple of the whole prefix it stands for
        self.next_id = 0

    # -- helpers --

    def _record_hashes(self, tokens):
        parent = None
        for i in range(len(tokens) // self.bs):
            prefix = tuple(tokens[:(i + 1) * self.bs])
            parent = hash_block_tokens(parent, prefix[-self.bs:])
            assert self.prefix_of_hash.setdefault(parent, prefix) == prefix

    def _write_kv(self, rid, start, end):
        req = self.reqs[rid]
        blocks = self.kv.get_blocks(rid)
        for p in range(start, end):
            block = blocks[p // self.bs]
            assert block.ref_cnt == 1 or self.kv_content[block.block_id][p % self.bs] == req["tokens"][p], \
                "writing into a shared block"
            self.kv_content.setdefault(block.block_id, [None] * self.bs)[p % self.bs] = req["tokens"][p]

    # -- rules --

    @rule(shared=st.integers(0, len(SYSTEM_PROMPT)),
          tail=st.lists(st.integers(0, VOCAB - 1), max_size=12))
    def add_request(self, shared, tail):
        """A prompt = some prefix of a common "system prompt" + a random tail."""
        prompt = SYSTEM_PROMPT[:shared] + tail or [0]
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.reqs[rid] = {"tokens": list(prompt), "computed": 0, "running": False}

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def schedule_one(self, data, chunk):
        self._schedule(data, data.draw(st.sampled_from(sorted(self.reqs))), chunk)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), chunk=st.integers(1, 8))
    def schedule_all(self, data, chunk):
        """One engine step: every request in turn (running and waiting alike)."""
        for rid in sorted(self.reqs):
            self._schedule(data, rid, chunk)

    def _schedule(self, data, rid, chunk):
        req = self.reqs[rid]
        tokens = req["tokens"]
        self._record_hashes(tokens)
        if req["running"]:
            hit_blocks, start = None, req["computed"]
        else:
            hit_blocks, start = self.kv.get_computed_blocks(rid, tokens)
            assert start % self.bs == 0 and 0 <= start < len(tokens)
            assert start == len(hit_blocks) * self.bs
            for i, b in enumerate(hit_blocks):  # the hit holds our tokens
                assert self.kv_content[b.block_id] == tokens[i * self.bs:(i + 1) * self.bs]
            if not self.kv.enable_caching:
                assert start == 0
        num_new = min(chunk, len(tokens) - start)
        # Fails exactly when the new blocks plus the revived free hits exceed the free pool.
        held = len(self.kv.get_blocks(rid)) + len(hit_blocks or ())
        demand = max(0, -(-(start + num_new) // self.bs) - held)
        demand += sum(1 for b in hit_blocks or () if b.ref_cnt == 0)
        should_fail = demand > self.kv.get_num_free_blocks()
        if hit_blocks:
            event("prefix hit")
            if any(b.ref_cnt == 0 for b in hit_blocks):
                event("hit revives a free cached block")
        before = snapshot(self.kv)
        new = self.kv.allocate_slots(rid, tokens, start, num_new, hit_blocks)
        assert (new is None) == should_fail
        if new is None:
            event("allocation failed")
            assert snapshot(self.kv) == before
            return
        if any(b.block_id in self.kv_content for b in new):
            event("reused a block")
        blocks = self.kv.get_blocks(rid)
        assert len(blocks) == -(-(start + num_new) // self.bs)
        assert blocks[len(blocks) - len(new):] == new
        self._write_kv(rid, start, start + num_new)
        req["running"] = True
        req["computed"] = start + num_new
        if req["computed"] == len(tokens):  # the step sampled a token
            tokens.append(data.draw(st.integers(0, VOCAB - 1)))

    @precondition(lambda self: any(r["running"] for r in self.reqs.values()))
    @rule(data=st.data())
    def preempt(self, data):
        rid = data.draw(st.sampled_from(sorted(r for r, q in self.reqs.items() if q["running"])))
        self.kv.free(rid)
        self.reqs[rid].update(computed=0, running=False)
        assert self.kv.get_block_ids(rid) == []

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.kv.free(rid)
        self.kv.free(rid)  # idempotent
        del self.reqs[rid]

    @rule()
    def reset_prefix_cache(self):
        owned = self.kv.num_owned_blocks()
        assert self.kv.reset_prefix_cache() == (owned == 0)
        if owned == 0:
            assert self.kv.block_pool.cached_block_hash_to_block == {}

    # -- invariants --

    @invariant()
    def manager_invariants(self):
        if not hasattr(self, "kv"):
            return
        kv = self.kv
        kv.check_invariants()
        holders = [0] * kv.num_blocks
        for rid, req in self.reqs.items():
            ids = kv.get_block_ids(rid)
            if not req["running"]:
                assert ids == []
                continue
            assert len(ids) == -(-req["computed"] // self.bs)
            for b in ids:
                holders[b] += 1
            for p in range(req["computed"]):  # KV of exactly the computed tokens
                assert self.kv_content[ids[p // self.bs]][p % self.bs] == req["tokens"][p]
        assert [b.ref_cnt for b in kv.block_pool.blocks] == holders
        assert kv.num_owned_blocks() == sum(1 for h in holders if h)
        assert kv.get_num_free_blocks() == holders.count(0)
        for h, block in kv.block_pool.cached_block_hash_to_block.items():
            assert self.kv_content[block.block_id] == list(self.prefix_of_hash[h][-self.bs:])
        if not kv.enable_caching:
            assert kv.block_pool.cached_block_hash_to_block == {}

    def teardown(self):
        if not hasattr(self, "kv"):
            return
        for rid in list(self.reqs):
            self.kv.free(rid)
        self.kv.check_invariants()
        assert self.kv.num_owned_blocks() == 0 and self.kv.usage == 0.0
        assert self.kv.get_num_free_blocks() == self.kv.num_blocks
        assert all(b.ref_cnt == 0 for b in self.kv.block_pool.blocks)
        assert not self.kv.req_to_blocks and not self.kv.req_to_block_hashes


KVCacheMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestKVCacheMachine = KVCacheMachine.TestCase


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 1), min_size=1, max_size=40), st.sampled_from([1, 2, 4, 16]))
def test_hit_is_longest_cached_prefix(tokens, bs):
    """After computing one sequence, a lookup of any extension hits exactly the shared full blocks."""
    kv = KVCacheManager(num_blocks=64, block_size=bs)
    prefill(kv, "a", list(tokens))
    for cut in range(len(tokens) + 1):
        query = tokens[:cut] + [2]  # token 2 never appears in `tokens`
        _, n = kv.get_computed_blocks("q", query)
        assert n == (cut // bs) * bs
        kv.free("q")
