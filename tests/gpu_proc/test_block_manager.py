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


def test_double_free_is_an_error():
    """Bookkeeping bugs raise instead of corrupting the free list."""
    bm = BlockManager(2, 16)
    b = bm.allocate_one()
    bm.free([b])
    with pytest.raises(BlockError):
        bm.free([b])
    bm.check_integrity()
    b = bm.allocate_one()
    with pytest.raises(BlockError):
        bm.free([b, b])  # one reference, freed twice


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
