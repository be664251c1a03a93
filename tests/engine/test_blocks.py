"""engine.blocks: the block pool's allocation, reference counts, prefix keys and LRU eviction."""

import pytest

from tilekit.engine.blocks import NULL_BLOCK, BlockPool, block_hashes


def test_allocation_never_hands_out_block_zero_and_fails_whole():
    pool = BlockPool(5, 4)
    taken = pool.allocate(4)
    assert sorted(taken) == [1, 2, 3, 4] and NULL_BLOCK not in taken
    assert pool.free == 0 and pool.used == 4
    assert pool.allocate(1) is None
    pool.release(taken[:2])
    assert pool.free == 2
    assert pool.allocate(3) is None and pool.free == 2      # nothing taken by a failed allocation


def test_keys_chain_over_blocks_and_ignore_a_partial_tail():
    keys = block_hashes(list(range(10)), 4)
    assert len(keys) == 2
    assert block_hashes(list(range(8)), 4) == keys
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[0] == keys[0]
    assert block_hashes([0, 1, 2, 3, 9, 9, 9, 9], 4)[1] != keys[1]
    assert block_hashes([4, 5, 6, 7], 4) != keys[1:]         # a block's key depends on its parent's
    assert block_hashes(list(range(4, 8)), 4, parent=keys[0]) == keys[1:]


def test_a_cached_prefix_is_shared_and_counted():
    pool = BlockPool(8, 4)
    keys = block_hashes(list(range(12)), 4)
    first = pool.allocate(3)
    for b, k in zip(first, keys):
        pool.cache(b, k)
    found = pool.lookup(keys[:2])
    assert found == first[:2] and pool.refs[first[0]] == 2
    pool.record_start(9, 8)
    assert pool.hit_rate == pytest.approx(8 / 9)
    pool.release(first)
    assert pool.refs[first[0]] == 1 and pool.refs[first[2]] == 0
    assert pool.lookup(keys) == first              # a freed block keeps its key until reused


def test_eviction_is_least_recently_freed_first_and_drops_the_key():
    pool = BlockPool(4, 2)
    a, b, c = pool.allocate(3)
    ka, kb = block_hashes([1, 2, 3, 4], 2)
    pool.cache(a, ka)
    pool.cache(b, kb)
    pool.release([a])
    pool.release([b, c])                                       # freed in reverse: c, then b
    assert list(pool.free_queue) == [a, c, b]
    (reused,) = pool.allocate(1)
    assert reused == a and pool.lookup([ka]) == []   # a's key went with it
    assert pool.lookup(block_hashes([9, 9], 2)) == []


def test_prefix_caching_off_finds_nothing():
    pool = BlockPool(4, 2, prefix_caching=False)
    (a,) = pool.allocate(1)
    (key,) = block_hashes([1, 2], 2)
    pool.cache(a, key)
    pool.release([a])
    assert pool.lookup([key]) == []


def test_double_release_and_bad_arguments_are_errors():
    pool = BlockPool(3, 2)
    (a,) = pool.allocate(1)
    pool.release([a])
    with pytest.raises(ValueError, match="released more often"):
        pool.release([a])
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(1, 2)
    with pytest.raises(ValueError, match="block"):
        BlockPool(4, 0)
