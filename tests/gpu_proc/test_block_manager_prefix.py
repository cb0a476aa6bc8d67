"""BlockManager with a prefix cache attached: parking, hits, eviction order, integrity."""

import pytest

from ringserve.gpu_proc.block_manager import BlockError, BlockManager, NoFreeBlocks
from ringserve.gpu_proc.prefix_cache import PrefixCache

BS = 4


def _make(num_blocks: int = 6) -> BlockManager:
    bm = BlockManager(num_blocks, BS)
    bm.attach_cache(PrefixCache(num_blocks, BS))
    return bm


def _register(bm: BlockManager, blocks: list[int], seq: list[int]) -> None:
    cache = bm.cache
    hashes = cache.extend_hashes([], lambda s, e: seq[s:e], len(blocks), None)
    for j, b in enumerate(blocks):
        assert cache.register(b, hashes[j], seq[j * BS : (j + 1) * BS], blocks[j - 1] if j else None, None)


def test_freed_registered_blocks_park_tail_first_and_partial_blocks_go_to_the_free_list():
    """A finished table [0, 1, 2] with two full cached blocks: 2 (partial) is plainly free,
    1 then 0 are parked (tail first, so the head of the chain is evicted last)."""
    bm = _make(6)
    table = bm.allocate(3)
    _register(bm, table[:2], list(range(10)))
    bm.free(table)
    assert bm.free_order() == [3, 4, 5, 2, 1, 0]
    assert (bm.num_free, bm.num_cached, bm.num_used) == (6, 2, 0)
    bm.check_integrity({})


def test_allocation_takes_plain_free_blocks_before_evicting_cached_ones():
    """Cached blocks survive until the plain free list is empty; then the oldest parked goes."""
    bm = _make(4)
    a = bm.allocate(2)
    _register(bm, a, list(range(8)))
    bm.free(a)  # parks 1 then 0
    assert bm.allocate(2) == [2, 3]
    assert bm.num_cached == 2
    assert bm.allocate_one() == 1 and not bm.cache.is_registered(1)  # oldest parked: evicted
    assert bm.cache.is_registered(0) and bm.num_cached == 1
    bm.check_integrity({1: 1, 2: 1, 3: 1})


def test_acquire_unparks_a_hit_and_shares_a_block_in_use():
    """A hit on a parked block takes it off the free side; a hit on a used block adds a reference."""
    bm = _make(4)
    a = bm.allocate(2)
    _register(bm, a, list(range(8)))
    bm.free([a[1]])  # block 1 parked, block 0 still held
    bm.acquire([0, 1])
    assert (bm.ref_count(0), bm.ref_count(1)) == (2, 1)
    assert bm.num_cached == 0 and bm.num_free == 2
    bm.check_integrity({0: 2, 1: 1})
    bm.free([0, 1])
    bm.free([0])
    assert bm.free_order() == [2, 3, 1, 0]
    bm.check_integrity({})


def test_eviction_order_follows_last_use():
    """Re-using a cached block and freeing it again makes it the most recently used."""
    bm = _make(3)
    x, y, z = bm.allocate(3)
    _register(bm, [x], [1, 1, 1, 1])
    _register(bm, [y], [2, 2, 2, 2])
    _register(bm, [z], [3, 3, 3, 3])
    bm.free([x])
    bm.free([y])
    bm.free([z])
    bm.acquire([x])
    bm.free([x])
    assert bm.cache.parked() == [y, z, x]
    assert bm.allocate(2) == [y, z]
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)


def test_shared_block_returns_only_after_last_reference():
    """A cached block read by three tables is parked only when the last one lets go."""
    bm = _make(4)
    blocks = bm.allocate(2)
    _register(bm, blocks, list(range(8)))
    bm.acquire(blocks)
    bm.acquire(blocks[:1])
    assert [bm.ref_count(b) for b in blocks] == [3, 2]
    bm.free(blocks)
    assert bm.num_free == 2 and bm.ref_count(0) == 2
    bm.free(blocks)
    assert bm.num_free == 3 and bm.ref_count(0) == 1
    bm.free([0])
    assert bm.num_free == 4 and bm.cache.parked() == [1, 0]
    bm.check_integrity()


def test_attach_and_acquire_are_checked():
    """A cache must fit the pool and be attached before use; only cached blocks can be acquired."""
    bm = BlockManager(4, BS)
    with pytest.raises(BlockError):
        bm.acquire([0])
    with pytest.raises(ValueError):
        bm.attach_cache(PrefixCache(5, BS))
    bm.allocate(1)
    with pytest.raises(BlockError):
        bm.attach_cache(PrefixCache(4, BS))
    bm2 = _make(4)
    with pytest.raises(BlockError):
        bm2.attach_cache(PrefixCache(4, BS))
    bm2.allocate(1)
    with pytest.raises(BlockError):
        bm2.acquire([0])


def test_integrity_catches_a_cached_block_on_the_plain_free_list():
    """A registered block that slipped onto the plain free list is reported."""
    bm = _make(2)
    a = bm.allocate(1)
    _register(bm, a, [1, 2, 3, 4])
    bm.free(a)
    bm._free.append(bm.cache.parked()[0])  # corrupt the books on purpose
    bm.cache._lru.clear()
    with pytest.raises(BlockError):
        bm.check_integrity({})
