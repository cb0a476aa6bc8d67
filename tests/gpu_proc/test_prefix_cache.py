"""PrefixCache alone: chain hashing, verified lookup, registration rules, the parked LRU."""

import pytest

from ringserve.gpu_proc.prefix_cache import PrefixCache, PrefixCacheError

BS = 4


def _tokens(seq):
    return lambda start, end: seq[start:end]


def _fill(cache: PrefixCache, seq: list[int], blocks: list[int], salt=None) -> list[int]:
    """Register `seq`'s full blocks into `blocks` in order, as the scheduler does; their hashes."""
    hashes = cache.extend_hashes([], _tokens(seq), len(seq) // BS, salt)
    for j, h in enumerate(hashes):
        assert cache.register(blocks[j], h, seq[j * BS : (j + 1) * BS], blocks[j - 1] if j else None, salt)
    return hashes


def test_chain_hash_depends_on_every_earlier_block_and_the_salt():
    """Equal blocks after different prefixes, or under different salts, hash differently."""
    c = PrefixCache(8, BS)
    a = c.extend_hashes([], _tokens([1, 2, 3, 4, 5, 6, 7, 8]), 2, None)
    b = c.extend_hashes([], _tokens([9, 2, 3, 4, 5, 6, 7, 8]), 2, None)
    s = c.extend_hashes([], _tokens([1, 2, 3, 4, 5, 6, 7, 8]), 2, "tenant-x")
    assert a[1] != b[1] and a[0] != s[0] and a[1] != s[1]
    assert c.extend_hashes(a[:1], _tokens([1, 2, 3, 4, 5, 6, 7, 8]), 2, None) == a  # extends, does not redo


def test_match_returns_the_longest_cached_run_in_order():
    """A sequence sharing two of three cached blocks matches exactly those two block ids."""
    c = PrefixCache(8, BS)
    _fill(c, list(range(1, 13)), [5, 2, 7])
    other = list(range(1, 9)) + [99, 98, 97, 96]
    hashes = c.extend_hashes([], _tokens(other), 3, None)
    assert c.match(hashes, _tokens(other), None) == [5, 2]
    assert c.match(hashes, _tokens(other), "salted") == []  # salt isolates


def test_colliding_hash_never_serves_another_prompts_blocks():
    """With a hash function that maps everything to one value, lookups compare tokens and parents
    and miss instead of returning a block holding other tokens."""
    c = PrefixCache(8, BS, hash_fn=lambda parent, tokens: 42)
    hashes = _fill(c, [1, 2, 3, 4], [3])
    assert hashes == [42]
    other = [5, 6, 7, 8]
    assert c.match(c.extend_hashes([], _tokens(other), 1, None), _tokens(other), None) == []
    assert c.match([42], _tokens([1, 2, 3, 4]), None) == [3]
    assert c.match([42], _tokens([1, 2, 3, 4]), "salt") == []  # same tokens, other root: a miss
    # the taken hash cannot be registered again: the other prompt's block stays uncached
    assert not c.register(4, 42, other, None, None)
    assert not c.is_registered(4)


def test_stale_parent_serial_makes_a_child_unreachable():
    """A child whose parent block was evicted and reused for other tokens is never matched
    through the new content, even when every hash collides (serials are never reused)."""
    c = PrefixCache(8, BS, hash_fn=lambda parent, tokens: hash(tokens))  # ignores the parent
    _fill(c, [1, 1, 1, 1, 2, 2, 2, 2], [0, 1])
    c.park(0)
    c.park(1)
    assert c.evict_oldest() == 0  # the parent goes; block 0 is reused for other tokens
    _fill(c, [3, 3, 3, 3], [0])
    seq = [3, 3, 3, 3, 2, 2, 2, 2]
    # block 1 holds [2, 2, 2, 2] computed after [1, 1, 1, 1]: its keys differ, so no hit
    assert c.match(c.extend_hashes([], _tokens(seq), 2, None), _tokens(seq), None) == [0]


def test_register_refuses_partial_blocks_and_unregistered_parents():
    """Only full blocks with a registered parent are cached."""
    c = PrefixCache(8, BS)
    with pytest.raises(ValueError):
        c.register(0, 1, [1, 2, 3], None, None)
    assert not c.register(1, 7, [1, 2, 3, 4], 0, None)  # parent block 0 is not registered
    assert c.register(0, 8, [1, 2, 3, 4], None, None)
    assert not c.register(0, 9, [5, 6, 7, 8], None, None)  # already registered
    assert c.num_registered == 1


def test_lru_evicts_the_least_recently_parked_and_forgets_its_hash():
    """park order is eviction order; unpark takes a block out; eviction unregisters it."""
    c = PrefixCache(8, BS)
    _fill(c, list(range(12)), [4, 5, 6])
    for b in (6, 4, 5):
        c.park(b)
    c.unpark(4)
    assert c.parked() == [6, 5]
    assert c.evict_oldest() == 6 and not c.is_registered(6)
    assert c.parked() == [5] and c.num_registered == 2


def test_check_integrity_catches_a_parked_block_still_referenced():
    """The cache's own check fails when the books disagree with the reference counts."""
    c = PrefixCache(4, BS)
    _fill(c, [1, 2, 3, 4], [2])
    c.check_integrity([0, 0, 1, 0])
    c.park(2)
    c.check_integrity([0, 0, 0, 0])
    with pytest.raises(PrefixCacheError):
        c.check_integrity([0, 0, 1, 0])
    with pytest.raises(PrefixCacheError):
        c.park(3)  # not registered


def test_constructor_validates_sizes():
    """Zero sizes are refused with a message."""
    with pytest.raises(ValueError):
        PrefixCache(0, 4)
    with pytest.raises(ValueError):
        PrefixCache(4, 0)
