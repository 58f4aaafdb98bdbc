"""Tests of the KV offload tier: the scheduler-side index (tinyvllm/core/kv_offload), its use by the
KV-cache manager (store on evict, load on hit, cache_salt), and the worker-side tiers
(tinyvllm/worker/kv_offload): exact round trips, the disk file's header and checksums."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tinyvllm.core.kv_cache_manager import KVCacheManager, hash_block_tokens
from tinyvllm.core.kv_offload import OffloadIndex

BS = 4


def chain(tokens, salt=None, bs=BS):
    """The expected block hashes, computed here independently of the manager."""
    out, parent = [], None
    for i in range(len(tokens) // bs):
        parent = hash_block_tokens(parent, tokens[i * bs:(i + 1) * bs],
                                   ("cache_salt", salt) if i == 0 and salt is not None else None)
        out.append(parent)
    return out


# -- the index ------------------------------------------------------------------

def test_index_lru_and_pins():
    idx = OffloadIndex(2)
    assert idx.prepare_store(10, block_id=0) and idx.prepare_store(11, block_id=1)
    stores, loads = idx.take_ops()
    assert [s[:2] for s in stores] == [(0, 0), (1, 1)] and loads == []
    assert stores[0][2] == f"{10:032x}"
    assert idx.prepare_store(10, block_id=5)  # already held: touched, no copy
    assert idx.take_ops() == ([], [])
    assert idx.prepare_store(12, block_id=2)  # evicts the LRU one, 11
    assert 11 not in idx and idx.lookup(12) == 1 and idx.lookup(10) == 0
    idx.take_ops()
    idx.prepare_load(12, block_id=7)  # pins slot 1
    assert idx.prepare_store(13, block_id=3)  # must take slot 0 (10), not the pinned slot 1
    assert idx.lookup(13) == 0 and idx.lookup(12) == 1
    assert not idx.prepare_store(14, block_id=4)  # both slots pinned this step: the store is dropped
    stores, loads = idx.take_ops()
    assert [s[:2] for s in stores] == [(3, 0)] and loads == [(1, 7)]
    assert idx.stats.dropped_stores == 1
    with pytest.raises(KeyError):
        idx.prepare_load(999, block_id=0)  # never hands out a hash it does not hold
    idx.check_invariants()


def test_index_entries_from_a_previous_run():
    idx = OffloadIndex(3, [(2, 100), (0, 101)])
    assert idx.lookup(100) == 2 and idx.lookup(101) == 0 and len(idx) == 2
    idx.prepare_store(102, 9)
    assert idx.lookup(102) == 1  # the only free slot
    idx.take_ops()
    idx.prepare_store(103, 9)  # evicts the oldest entry, 100
    assert 100 not in idx
    with pytest.raises(ValueError):
        OffloadIndex(2, [(5, 1)])


# -- manager + tier: store on evict, load on hit ---------------------------------

def run_step(kv, pool, tier):
    """What the worker does with a step's copies: every store, then every load."""
    stores, loads = kv.take_offload_ops()
    for block_id, slot, h in stores:
        tier[slot] = pool.get(block_id)
        assert int(h, 16) == pool.get(block_id)  # the hash of the stored content travels with it
    for slot, block_id in loads:
        pool[block_id] = tier[slot]
    return stores, loads


def forward(kv, pool, rid, tokens, salt, start, end):
    """The forward writes KV for tokens [start, end): a full block's content is its hash."""
    blocks = kv.get_blocks(rid)
    want = chain(tokens[:end], salt)
    for i in range(start // BS, -(-end // BS)):
        pool[blocks[i].block_id] = want[i] if (i + 1) * BS <= end else ("partial", rid, i)


def test_evicted_blocks_come_back_from_the_tier():
    kv = KVCacheManager(4, BS, offload=OffloadIndex(8))
    pool, tier = {}, {}
    a = list(range(100, 113))  # 3 full blocks + 1 token
    hit, n = kv.get_computed_blocks("a", a)
    assert n == 0 and kv.allocate_slots("a", a, 0, len(a), hit) is not None
    run_step(kv, pool, tier)
    forward(kv, pool, "a", a, None, 0, len(a))
    kv.free("a")
    b = list(range(200, 213))  # takes all 4 blocks: evicts a's 3 cached blocks into the tier
    hit, n = kv.get_computed_blocks("b", b)
    assert kv.allocate_slots("b", b, 0, len(b), hit) is not None
    stores, _ = run_step(kv, pool, tier)
    assert len(stores) == 3
    forward(kv, pool, "b", b, None, 0, len(b))
    kv.free("b")
    hit, n = kv.get_computed_blocks("a2", a)
    assert hit == [] and n == 12 and kv.num_tier_hit_tokens("a2") == 12
    assert kv.allocate_slots("a2", a, n, len(a) - n, hit) is not None
    _, loads = run_step(kv, pool, tier)
    assert len(loads) == 3
    blocks = kv.get_blocks("a2")
    assert [pool[b.block_id] for b in blocks[:3]] == chain(a)  # the loaded KV is a's
    kv.check_invariants()
    kv.free("a2")
    assert kv.num_owned_blocks() == 0


def test_cache_salt_separates_requests():
    kv = KVCacheManager(16, BS, offload=OffloadIndex(8))
    t = list(range(50, 59))
    for rid, salt in (("x", "alice"), ("y", None)):
        hit, n = kv.get_computed_blocks(rid, t, salt)
        assert n == 0  # neither the salted nor the unsalted request sees the other's blocks
        kv.allocate_slots(rid, t, 0, len(t), hit)
    assert kv.req_to_block_hashes["x"] == chain(t, "alice") != chain(t)
    assert kv.req_to_block_hashes["y"] == chain(t)
    _, n = kv.get_computed_blocks("z", t, "alice")
    assert n == 8  # the same salt shares
    _, n = kv.get_computed_blocks("w", t, "bob")
    assert n == 0
    kv.free("x"), kv.free("y"), kv.free("z"), kv.free("w")
    kv.check_invariants()


class PoolAndTier(RuleBasedStateMachine):
    """Random requests over a small pool and a small tier, with the worker's copies and the forward
    simulated on a content map: every block a request holds must contain exactly the KV of its tokens
    (a loaded block the KV that was stored for that hash), the bookkeeping stays consistent, and no
    block is owned once every request is freed."""

    @initialize(num_blocks=st.integers(3, 12), num_slots=st.integers(1, 8))
    def setup(self, num_blocks, num_slots):
        self.kv = KVCacheManager(num_blocks, BS, offload=OffloadIndex(num_slots))
        self.pool: dict = {}
        self.tier: dict = {}
        self.reqs: dict[str, tuple[list[int], str | None, int]] = {}  # rid -> (tokens, salt, computed)
        self.n = 0

    @rule(prefix=st.sampled_from([[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9]]),
          tail=st.lists(st.integers(1, 3), max_size=9), salt=st.sampled_from([None, None, "s"]))
    def add(self, prefix, tail, salt):
        tokens = prefix + tail
        if not tokens:
            return
        rid = f"r{self.n}"
        self.n += 1
        hit, num = self.kv.get_computed_blocks(rid, tokens, salt)
        assert num % BS == 0 and num < len(tokens)
        new = self.kv.allocate_slots(rid, tokens, num, len(tokens) - num, hit)
        run_step(self.kv, self.pool, self.tier)
        if new is None:
            self.kv.free(rid)
            return
        forward(self.kv, self.pool, rid, tokens, salt, num, len(tokens))
        self.reqs[rid] = (tokens, salt, len(tokens))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), tok=st.integers(1, 3))
    def decode(self, data, tok):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tokens, salt, computed = self.reqs[rid]
        tokens = tokens + [tok]
        if self.kv.allocate_slots(rid, tokens, computed, 1) is None:
            run_step(self.kv, self.pool, self.tier)
            return
        run_step(self.kv, self.pool, self.tier)
        forward(self.kv, self.pool, rid, tokens, salt, computed, computed + 1)
        self.reqs[rid] = (tokens, salt, computed + 1)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        del self.reqs[rid]
        self.kv.free(rid)

    @invariant()
    def consistent(self):
        if not hasattr(self, "kv"):
            return
        self.kv.check_invariants()
        for rid, (tokens, salt, computed) in self.reqs.items():
            want = chain(tokens[:computed], salt)
            blocks = self.kv.get_blocks(rid)
            assert [self.pool.get(b.block_id) for b in blocks[:len(want)]] == want, rid
        for h, slot in self.kv.offload._lru.items():  # the tier holds what its index says
            assert self.tier.get(slot) == h
        for h, block in self.kv.block_pool.cached_block_hash_to_block.items():
            if block.ref_cnt == 0:  # a free cached block still holds its content
                assert self.pool.get(block.block_id) == h

    def teardown(self):
        if hasattr(self, "kv"):
            for rid in list(self.reqs):
                self.kv.free(rid)
            assert self.kv.num_owned_blocks() == 0
            self.kv.check_invariants()


TestPoolAndTier = PoolAndTier.TestCase
TestPoolAndTier.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


# -- worker side: exact round trips, the disk file ---------------------------------

def _caches(num_blocks=6, layers=3, seed=0, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, num_blocks, BS, 2, 8, generator=g).to(dtype) for _ in range(layers)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_host_tier_round_trip_is_exact(dtype):
    from tinyvllm.worker.kv_offload import HostKVTier

    kv = _caches(dtype=dtype)
    tier = HostKVTier(4, (3, 2, BS, 2, 8), dtype)
    before = [c.clone() for c in kv]
    tier.store(kv, [(1, 2, "0" * 32), (4, 0, "1".zfill(32))])
    for c in kv:
        c[:, [1, 4]] = 0
    tier.load(kv, [(2, 1), (0, 4)])
    assert all(torch.equal(a.view(torch.uint8) if a.dtype == torch.bfloat16 else a, b.view(torch.uint8)
               if b.dtype == torch.bfloat16 else b) for a, b in zip(kv, before))
    tier.load(kv, [(2, 5)])  # into another block: a byte copy of block 1
    assert all(torch.equal(c[:, 5], c[:, 1]) for c in kv)


def _fp(**kw):
    from tinyvllm.worker.kv_offload import make_fingerprint

    return make_fingerprint("/nonexistent-model", torch.bfloat16, BS, 3, 2, 8, kw or None)


def test_disk_tier_persists_and_rejects_foreign_or_corrupt(tmp_path, caplog):
    from tinyvllm.worker.kv_offload import DiskKVTier

    kv = _caches()
    shape = (3, 2, BS, 2, 8)
    t = DiskKVTier(tmp_path, 4, shape, torch.bfloat16, _fp())
    assert t.entries() == []
    h1, h2 = 2**127 + 5, 77
    t.store(kv, [(1, 3, f"{h1:032x}"), (2, 0, f"{h2:032x}")])
    t.close()
    # Reopened with the same fingerprint: both blocks, oldest store first, bytes intact.
    t = DiskKVTier(tmp_path, 4, shape, torch.bfloat16, _fp())
    assert t.entries() == [(3, h1), (0, h2)]
    out = _caches(seed=1)
    t.load(out, [(3, 0), (0, 5)])
    assert all(torch.equal(o[:, 0], c[:, 1]) and torch.equal(o[:, 5], c[:, 2]) for o, c in zip(out, kv))
    t.close()
    # One byte flipped in slot 0's data: that slot is dropped with one warning, the other kept.
    from tinyvllm.worker import kv_offload as mod

    data_off = -(-(4096 + 4 * 5 * 8) // 4096) * 4096
    with open(tmp_path / mod.FILE_NAME, "r+b") as f:
        f.seek(data_off + 10)
        b = f.read(1)
        f.seek(data_off + 10)
        f.write(bytes([b[0] ^ 0xFF]))
    with caplog.at_level("WARNING", logger="tinyvllm"):
        t = DiskKVTier(tmp_path, 4, shape, torch.bfloat16, _fp())
    assert t.entries() == [(3, h1)]
    assert sum("checksum" in r.message for r in caplog.records) == 1
    t.close()
    # Another model/config: nothing is reused, one warning.
    caplog.clear()
    with caplog.at_level("WARNING", logger="tinyvllm"):
        t = DiskKVTier(tmp_path, 4, shape, torch.bfloat16, _fp(seed=1))
    assert t.entries() == []
    assert sum("another model" in r.message for r in caplog.records) == 1
    t.close()
    # A different size is another layout: re-initialized too.
    t = DiskKVTier(tmp_path, 4, shape, torch.bfloat16, _fp(seed=1))
    t.store(kv, [(1, 1, f"{h1:032x}")])
    t.close()
    assert DiskKVTier(tmp_path, 5, shape, torch.bfloat16, _fp(seed=1)).entries() == []


def test_disk_tier_kill_mid_write_leaves_slot_ignored(tmp_path):
    """A store interrupted after the data but before its record: the next open ignores the slot."""
    from tinyvllm.worker.kv_offload import DiskKVTier

    kv = _caches()
    shape = (3, 2, BS, 2, 8)
    t = DiskKVTier(tmp_path, 2, shape, torch.bfloat16, _fp())
    t.store(kv, [(1, 0, f"{5:032x}"), (2, 1, f"{6:032x}")])
    t._before_write([1])  # the next store of slot 1 begins: valid flag cleared ...
    t.data[1].zero_()  # ... data half written, then the process dies
    t.close()
    t = DiskKVTier(tmp_path, 2, shape, torch.bfloat16, _fp())
    assert t.entries() == [(0, 5)]


def test_disk_tier_unwritable_path_is_a_clear_error(tmp_path):
    from tinyvllm.worker.kv_offload import DiskKVTier, KVTierError

    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(KVTierError, match="kv-offload-path"):
        DiskKVTier(blocker / "sub", 2, (3, 2, BS, 2, 8), torch.bfloat16, _fp())



def test_disk_tier_full_disk_is_a_clear_error(tmp_path, monkeypatch):
    """The free space is checked before anything is allocated (a real full disk is not made here:
    the disk is shared, and a failed fallocate can leave what it allocated)."""
    import collections

    from tinyvllm.worker import kv_offload as mod

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(mod.shutil, "disk_usage", lambda _: usage(10**6, 10**6 - 1000, 1000))
    with pytest.raises(mod.KVTierError, match="only 0.00 GiB are free"):
        mod.DiskKVTier(tmp_path, 4, (3, 2, BS, 2, 8), torch.bfloat16, _fp())
    assert (tmp_path / mod.FILE_NAME).stat().st_size == 0  # nothing reserved


def test_bench_per_turn_computed_tokens_and_history_share():
    from tinyvllm.benchmarks.metrics import RequestRecord, per_turn_stats

    recs = [RequestRecord(0, success=True, ttft=0.1, e2e=0.2, prompt_tokens=100, output_tokens=20, cached_tokens=0,
                          session_id=0, turn=0),
            RequestRecord(1, success=True, ttft=0.1, e2e=0.2, prompt_tokens=160, output_tokens=20, cached_tokens=112,
                          session_id=0, turn=1),
            RequestRecord(2, success=True, ttft=0.1, e2e=0.2, prompt_tokens=100, output_tokens=20, cached_tokens=0,
                          session_id=1, turn=0),
            RequestRecord(3, success=True, ttft=0.1, e2e=0.2, prompt_tokens=160, output_tokens=20, cached_tokens=48,
                          session_id=1, turn=1)]
    t0, t1 = per_turn_stats(recs)
    assert t0["total_computed_tokens"] == 200 and t0["mean_history_cached_frac"] is None
    assert t1["total_computed_tokens"] == 48 + 112 and t1["mean_computed_tokens"] == 80
    assert t1["mean_history_cached_frac"] == pytest.approx((112 / 120 + 48 / 120) / 2)
