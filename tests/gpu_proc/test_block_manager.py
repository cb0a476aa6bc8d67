"""Block manager: exact ids, reference counts, FIFO free list, integrity checks."""

import pytest

from ringserve.gpu_proc.block_manager import BlockError, BlockManager, NoFreeBlocks


def test_allocate_takes_lowest_ids_first_and_free_goes_to_the_back():
    """Fresh pool hands out 0, 1, 2...; freed blocks are reused only after the untouched ones."""
    bm = BlockManager(6, 16)
    assert bm.allocate(3) == [0, 1, 2]
    bm.free([1])
    assert bm.allocate(3) == [3, 4, 5]
    assert bm.allocate_one() == 1
    assert bm.num_free == 0
    bm.check_integrity()


def test_allocation_is_all_or_nothing():
    """Asking for more than is free raises and takes nothing."""
    bm = BlockManager(4, 16)
    bm.allocate(3)
    with pytest.raises(NoFreeBlocks):
        bm.allocate(2)
    assert bm.num_free == 1
    assert bm.allocate(1) == [3]
    with pytest.raises(NoFreeBlocks):
        bm.allocate_one()


def test_shared_block_returns_only_after_last_reference():
    """A block shared by n samples goes back to the free list when the last one lets go."""
    bm = BlockManager(4, 16)
    blocks = bm.allocate(2)
    bm.share(blocks)
    bm.share(blocks[:1])
    assert [bm.ref_count(b) for b in blocks] == [3, 2]
    bm.free(blocks)
    assert bm.num_free == 2 and bm.ref_count(0) == 2
    bm.free(blocks)
    assert bm.num_free == 3 and bm.ref_count(0) == 1
    bm.free([0])
    assert bm.num_free == 4
    bm.check_integrity()


def test_double_free_and_sharing_a_free_block_are_errors():
    """Bookkeeping bugs raise instead of corrupting the free list."""
    bm = BlockManager(2, 16)
    b = bm.allocate_one()
    bm.free([b])
    with pytest.raises(BlockError):
        bm.free([b])
    with pytest.raises(BlockError):
        bm.share([b])
    bm.check_integrity()


def test_blocks_for_rounds_up_to_whole_blocks():
    """Tokens map to blocks of 16: 1..16 -> 1, 17 -> 2, 0 -> 0."""
    bm = BlockManager(2, 16)
    assert [bm.blocks_for(t) for t in (0, 1, 16, 17, 32, 33)] == [0, 1, 1, 2, 2, 3]


def test_integrity_compares_against_block_tables():
    """check_integrity(expected) fails when a table's view differs from the ref counts."""
    bm = BlockManager(4, 16)
    a = bm.allocate(2)
    bm.check_integrity({a[0]: 1, a[1]: 1})
    with pytest.raises(BlockError):
        bm.check_integrity({a[0]: 1})  # a leaked block: allocated but in no table
    with pytest.raises(BlockError):
        bm.check_integrity({a[0]: 2, a[1]: 1})


def test_integrity_detects_corrupted_free_list():
    """A duplicated free-list entry or a used block in the free list is caught."""
    bm = BlockManager(3, 16)
    bm.allocate(1)
    bm._free.append(0)  # simulate a bug
    with pytest.raises(BlockError):
        bm.check_integrity()


def test_bad_sizes_rejected():
    """Zero or negative sizes are errors at construction."""
    with pytest.raises(ValueError):
        BlockManager(0)
    with pytest.raises(ValueError):
        BlockManager(4, 0)


def test_shared_prefix_tables_and_fork_copies_partial_block():
    """Prefix of 5 tokens in 4-token blocks: [0, 1]; two rows of 6 tokens share block 0 and own
    2 and 3; the fork copies partial block 1 into each and frees it."""
    bm = BlockManager(8, 4)
    prefix, tables = bm.allocate_shared(5, [6, 6])
    assert prefix == [0, 1] and tables == [[0, 2], [0, 3]]
    assert [bm.ref_count(b) for b in range(4)] == [3, 1, 1, 1]
    assert bm.fork(prefix, 5, tables) == [(1, 2), (1, 3)]
    assert [bm.ref_count(b) for b in range(4)] == [2, 0, 1, 1]
    bm.check_integrity({0: 2, 2: 1, 3: 1})


def test_block_aligned_prefix_forks_without_copies():
    """A prefix ending on a block boundary leaves nothing partial to copy."""
    bm = BlockManager(8, 4)
    prefix, tables = bm.allocate_shared(4, [5, 9])
    assert prefix == [0] and tables == [[0, 1], [0, 2, 3]]
    assert bm.fork(prefix, 4, tables) == []
    assert bm.ref_count(0) == 2


def test_allocate_shared_is_all_or_nothing():
    """Not enough blocks for prefix + every row: nothing is taken."""
    bm = BlockManager(4, 4)
    with pytest.raises(NoFreeBlocks):
        bm.allocate_shared(5, [9, 9])
    assert bm.num_free == 4
