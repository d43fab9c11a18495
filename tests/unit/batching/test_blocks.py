"""The KV block pool and its prefix-cache index, without a model."""

from __future__ import annotations

import pytest

from tests.unit.work_counter import Work, count_work
from tgis.batching.blocks import BlockPool, OutOfBlocksError, PoolUsage, chain_start, full_block_hashes


def test_allocate_hands_out_distinct_blocks_and_free_returns_them():
    pool = BlockPool(4, 16)
    first = pool.allocate(3)
    assert len(set(first)) == 3
    assert pool.num_free == 1
    pool.free(first)
    assert pool.num_free == 4
    assert pool.usage().used == 0


def test_asking_for_more_blocks_than_free_raises_and_changes_nothing():
    pool = BlockPool(2, 16)
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError, match="asked for 2 KV blocks, 1 free"):
        pool.allocate(2)
    assert pool.num_free == 1


def test_freeing_a_block_more_often_than_taken_is_an_error():
    pool = BlockPool(2, 16)
    (block,) = pool.allocate(1)
    pool.free([block])
    with pytest.raises(ValueError, match="freed more often"):
        pool.free([block])


def test_shared_block_stays_in_use_until_its_last_reference_is_dropped():
    pool = BlockPool(2, 4)
    (block,) = pool.allocate(1)
    digest = full_block_hashes([1, 2, 3, 4], 4, None)[0]
    pool.register(block, digest)
    assert pool.cached_prefix([digest]) == [block]
    pool.take([block])
    assert pool.refs(block) == 2
    pool.free([block])
    assert pool.num_free == 1  # still referenced once
    pool.free([block])
    assert pool.num_free == 2
    assert pool.usage().cached == 1


def test_freed_cached_block_is_found_again_until_it_is_evicted():
    pool = BlockPool(3, 4)
    blocks = pool.allocate(2)
    hashes = full_block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4, None)
    for block, digest in zip(blocks, hashes, strict=True):
        pool.register(block, digest)
    pool.free(blocks)
    assert pool.cached_prefix(hashes) == blocks
    # Three fresh blocks need every block: the cached ones are evicted and forgotten.
    pool.allocate(3)
    assert pool.cached_prefix(hashes) == []


def test_blocks_without_content_are_reused_before_cached_ones():
    pool = BlockPool(3, 4)
    cached, plain = pool.allocate(1), pool.allocate(1)
    pool.register(cached[0], full_block_hashes([9, 9, 9, 9], 4, None)[0])
    pool.free(cached)
    pool.free(plain)
    # The plain freed block first, then the never-used one; the cached block is kept.
    assert pool.allocate(2) == [plain[0], 2]
    assert pool.usage().cached == 1


def test_eviction_takes_the_least_recently_freed_and_a_sequence_tail_before_its_head():
    pool = BlockPool(4, 2)
    old = pool.allocate(2)
    new = pool.allocate(2)
    for blocks, tokens in ((old, [1, 2, 3, 4]), (new, [5, 6, 7, 8])):
        for block, digest in zip(blocks, full_block_hashes(tokens, 2, None), strict=True):
            pool.register(block, digest)
    pool.free(old)
    pool.free(new)
    (evicted,) = pool.allocate(1)
    assert evicted == old[1]  # the older sequence's tail goes first, its head block stays findable
    assert pool.cached_prefix(full_block_hashes([1, 2, 3, 4], 2, None)) == [old[0]]


def test_the_same_tokens_under_another_adapter_hash_differently():
    tokens = list(range(8))
    plain = full_block_hashes(tokens, 4, None)
    tuned = full_block_hashes(tokens, 4, "support-bot")
    assert set(plain).isdisjoint(tuned)
    assert chain_start("a") != chain_start("b")


def test_hashes_chain_so_equal_blocks_after_different_prefixes_differ():
    a = full_block_hashes([1, 2, 7, 7], 2, None)
    b = full_block_hashes([3, 4, 7, 7], 2, None)
    assert a[1] != b[1]
    assert full_block_hashes([1, 2, 7, 7, 5], 2, None, known=a[:1]) == a  # a partial tail is not hashed


def test_a_block_computed_twice_keeps_the_first_copy_as_the_cached_one():
    pool = BlockPool(2, 2)
    first, second = pool.allocate(2)
    digest = full_block_hashes([1, 2], 2, None)[0]
    pool.register(first, digest)
    pool.register(second, digest)
    assert pool.cached_prefix([digest]) == [first]


def test_a_pool_without_prefix_caching_never_finds_anything():
    pool = BlockPool(2, 2, prefix_caching=False)
    (block,) = pool.allocate(1)
    digest = full_block_hashes([1, 2], 2, None)[0]
    pool.register(block, digest)
    pool.free([block])
    assert pool.cached_prefix([digest]) == []


def test_usage_counts_stay_exact_through_caching_eviction_and_sharing():
    pool = BlockPool(6, 2)
    hashes = full_block_hashes([1, 2, 3, 4, 5, 6], 2, None)
    first = pool.allocate(3)
    for block, digest in zip(first, hashes, strict=True):
        pool.register(block, digest)
    assert pool.usage() == PoolUsage(total=6, used=3, cached=0)
    pool.free(first)
    assert pool.usage() == PoolUsage(total=6, used=0, cached=3)
    found = pool.cached_prefix(hashes[:2])
    pool.take(found)
    assert pool.usage() == PoolUsage(total=6, used=2, cached=1)
    pool.allocate(4)  # three never-used blocks, then the last cached one is evicted
    assert pool.usage() == PoolUsage(total=6, used=6, cached=0)
    assert pool.usage() == _counted(pool)


def _counted(pool: BlockPool) -> PoolUsage:
    """The usage found by looking at every block (what the counters stand in for)."""
    used = sum(1 for block in range(pool.num_blocks) if pool.refs(block))
    cached = sum(1 for block in pool._free if pool._hashes[block] is not None)
    return PoolUsage(pool.num_blocks, used, cached)


def _bookkeeping_work(num_blocks: int) -> Work:
    """One decode step's pool bookkeeping for 32 sequences, repeated: allocate a block each, register
    the full ones, free the finished, read the usage twice (as the gauges do)."""
    pool = BlockPool(num_blocks, 16)
    held = [pool.allocate(8) for _ in range(32)]

    def steps() -> None:
        for step in range(200):
            for sequence, blocks in enumerate(held):
                blocks += pool.allocate(1)
                digest = full_block_hashes(list(range(16)), 16, f"{step}-{sequence}")[0]
                pool.register(blocks[-2], digest)
                pool.free(blocks[-1:])
                del blocks[-1]
            pool.usage()
            pool.usage()

    return count_work(steps)


def test_step_bookkeeping_does_not_grow_with_the_pool():
    """Pool usage and gauges are counters: a million-block pool (a large GPU's) runs a step's Python
    lines and calls of a thousand-block one. Walking the free blocks, as before, ran a line per block."""
    small = _bookkeeping_work(1_000)
    assert small.lines > 1_000 and small.calls > 1_000, small
    large = _bookkeeping_work(1_000_000)
    assert large.about(small), (small, large)
