"""Unit tests of the free queue and the block pool (tinyvllm/core/block_pool.py)."""

import pytest
from hypothesis import given, settings, strategies as st

from tinyvllm.core.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock


def ids(blocks):
    return [b.block_id for b in blocks]


# -- FreeKVCacheBlockQueue ---------------------------------------------------

def test_queue_fifo_order_and_counts():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    assert len(q) == q.num_free_blocks == 5
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4]
    assert q.popleft() is blocks[0]
    assert q.popleft() is blocks[1]
    q.append(blocks[0])
    assert ids(q) == [2, 3, 4, 0]
    assert q.num_free_blocks == 4


def test_queue_remove_middle_head_tail():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeKVCacheBlockQueue(blocks)
    q.remove(blocks[2])
    assert ids(q) == [0, 1, 3, 4]
    assert blocks[2].prev_free_block is None and blocks[2].next_free_block is None
    q.remove(blocks[0])
    q.remove(blocks[4])
    assert ids(q) == [1, 3]
    assert q.num_free_blocks == 2
    q.append(blocks[2])
    assert ids(q) == [1, 3, 2]
    assert ids([q.popleft() for _ in range(3)]) == [1, 3, 2]
    assert len(q) == 0 and list(q) == []


def test_queue_errors():
    a, b = KVCacheBlock(0), KVCacheBlock(1)
    q = FreeKVCacheBlockQueue([a])
    with pytest.raises(ValueError):
        q.append(a)  # already queued
    with pytest.raises(ValueError):
        q.remove(b)  # not queued
    q.popleft()
    with pytest.raises(ValueError):
        q.popleft()  # empty
    assert "KVCacheBlock(id=0" in repr(a)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["pop", "append", "remove"]), st.integers(0, 7)), max_size=60))
def test_queue_matches_list_model(ops):
    blocks = [KVCacheBlock(i) for i in range(8)]
    q = FreeKVCacheBlockQueue(blocks)
    model = list(range(8))
    for op, i in ops:
        if op == "pop":
            if model:
                assert q.popleft().block_id == model.pop(0)
            else:
                with pytest.raises(ValueError):
                    q.popleft()
        elif op == "append":
            if i in model:
                with pytest.raises(ValueError):
                    q.append(blocks[i])
            else:
                q.append(blocks[i])
                model.append(i)
        else:
            if i in model:
                q.remove(blocks[i])
                model.remove(i)
            else:
                with pytest.raises(ValueError):
                    q.remove(blocks[i])
        assert ids(q) == model and q.num_free_blocks == len(model)


# -- BlockPool ---------------------------------------------------------------

def test_get_new_blocks_and_exhaustion():
    pool = BlockPool(4, enable_caching=True)
    assert pool.get_num_free_blocks() == 4 and pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [0, 1, 2]  # block 0 is an ordinary block
    assert all(b.ref_cnt == 1 for b in got)
    assert pool.get_usage() == pytest.approx(0.75)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert pool.get_num_free_blocks() == 1  # a failed call takes nothing
    assert pool.get_new_blocks(0) == []
    with pytest.raises(ValueError):
        pool.get_new_blocks(-1)
    with pytest.raises(ValueError):
        BlockPool(0, True)


def test_free_goes_to_tail_in_given_order():
    pool = BlockPool(5, True)
    a = pool.get_new_blocks(3)  # 0 1 2; free queue: 3 4
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue) == [3, 4, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in a)
    with pytest.raises(ValueError):
        pool.free_blocks([a[0]])  # double free


def test_shared_block_freed_only_at_zero():
    pool = BlockPool(3, True)
    (b,) = pool.get_new_blocks(1)
    pool.touch([b])
    assert b.ref_cnt == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 1 and pool.get_num_free_blocks() == 2
    pool.free_blocks([b])
    assert b.ref_cnt == 0 and pool.get_num_free_blocks() == 3


def test_cached_free_block_is_hit_then_evicted_on_reuse():
    pool = BlockPool(2, True)
    b0, b1 = pool.get_new_blocks(2)
    assert pool.cache_full_block(b0, 111)
    pool.free_blocks([b1, b0])  # queue: 1, 0 ; b0 keeps its hash
    assert b0.block_hash == 111 and pool.get_cached_block(111) is b0
    # A hit revives the free block: it leaves the queue, not evicted.
    pool.touch([b0])
    assert b0.ref_cnt == 1 and ids(pool.free_block_queue) == [1]
    pool.free_blocks([b0])  # queue: 1, 0
    # Allocation pressure pops block 1 first (LRU), then evicts block 0.
    (x,) = pool.get_new_blocks(1)
    assert x is b1 and pool.get_cached_block(111) is b0
    (y,) = pool.get_new_blocks(1)
    assert y is b0 and y.block_hash is None and pool.get_cached_block(111) is None


def test_cache_full_block_keeps_existing_mapping():
    pool = BlockPool(3, True)
    a, b = pool.get_new_blocks(2)
    assert pool.cache_full_block(a, 7)
    assert not pool.cache_full_block(b, 7)  # duplicate content: first block wins
    assert b.block_hash is None and pool.get_cached_block(7) is a
    assert pool.cache_full_block(a, 7)  # idempotent
    with pytest.raises(ValueError):
        pool.cache_full_block(a, 8)  # different hash for a cached block
    c = pool.blocks[2]
    with pytest.raises(ValueError):
        pool.cache_full_block(c, 9)  # free block


def test_caching_disabled_never_caches():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    assert not pool.cache_full_block(a, 5)
    assert a.block_hash is None and pool.get_cached_block(5) is None


def test_reset_prefix_cache():
    pool = BlockPool(2, True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, 1)
    pool.free_blocks([b])
    assert not pool.reset_prefix_cache()  # a is still owned
    assert pool.get_cached_block(1) is a
    pool.free_blocks([a])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(1) is None and a.block_hash is None
    assert pool.get_num_free_blocks() == 2
