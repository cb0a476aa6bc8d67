"""The KV block allocator: a free list and a reference count per block (pure Python).

The GPU pool itself (`kv_pool.py`) is only memory; which block belongs to whom is decided here.
A block is free exactly when its reference count is 0. Counts above 1 mean several requests read
one prefix-cache block (the siblings of an n > 1 request among them); only full blocks are ever
shared, so no sequence writes a block another one reads (`docs/design.md#kv-cache`).

Free-list order is FIFO: a freed block goes to the back and allocation takes from the front, so
block ids are predictable (tests assert exact ids) and a just-freed block is reused last.

With a prefix cache attached (`attach_cache`), a freed block that the cache has registered (a full
block with a known prefix) is *parked* in the cache's LRU instead: still free, but kept until
needed. Allocation takes plain free blocks first and then evicts the oldest parked block; `acquire`
takes a reference to a cache hit, un-parking it. A table is freed last block first, so a
sequence's tail is evicted before the head its descendants hang from.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING

from ringserve.config import DEFAULTS

if TYPE_CHECKING:
    from ringserve.gpu_proc.prefix_cache import PrefixCache


class NoFreeBlocks(RuntimeError):
    """An allocation asked for more blocks than are free; nothing was allocated."""


class BlockError(RuntimeError):
    """A block id was freed or shared while not allocated, or is out of range: a bookkeeping bug."""


class BlockManager:
    """Allocate, share and free fixed-size KV blocks of `block_size` token slots each."""

    __slots__ = ("num_blocks", "block_size", "cache", "_free", "_refs")

    def __init__(self, num_blocks: int, block_size: int = DEFAULTS.block_size, order: list[int] | None = None) -> None:
        """`order`: the free list's first order, a permutation of the block ids (default: in id
        order); offline runs shuffle it so tables are not in position order."""
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if order is not None and sorted(order) != list(range(num_blocks)):
            raise ValueError(f"order must be a permutation of the {num_blocks} block ids")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks) if order is None else order)
        self._refs: list[int] = [0] * num_blocks
        self.cache: PrefixCache | None = None

    def attach_cache(self, cache: PrefixCache) -> None:
        """Keep registered blocks cached when freed (see the module docstring); only on a pool
        with nothing allocated yet, so every block's history is known to the cache."""
        if self.cache is not None:
            raise BlockError("a prefix cache is already attached")
        if self.num_used:
            raise BlockError(f"attach the prefix cache before allocating ({self.num_used} blocks in use)")
        if (cache.num_blocks, cache.block_size) != (self.num_blocks, self.block_size):
            raise ValueError(
                f"cache is for {cache.num_blocks} x {cache.block_size}-token blocks, "
                f"pool has {self.num_blocks} x {self.block_size}"
            )
        self.cache = cache

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take now, parked cached blocks included."""
        return len(self._free) + (self.cache.num_parked if self.cache is not None else 0)

    @property
    def num_cached(self) -> int:
        """Free blocks that still hold a cached prefix (parked)."""
        return self.cache.num_parked if self.cache is not None else 0

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def free_order(self) -> list[int]:
        """Every free block in the order allocation takes them (plain first, then oldest parked)."""
        return list(self._free) + (self.cache.parked() if self.cache is not None else [])

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens from position 0."""
        return -(-num_tokens // self.block_size)

    # -- verbs -----------------------------------------------------------------------------------

    def allocate(self, count: int) -> list[int]:
        """`count` fresh blocks, each with reference count 1; all or nothing."""
        if count < 0:
            raise ValueError(f"cannot allocate {count} blocks")
        if count > self.num_free:
            raise NoFreeBlocks(f"asked for {count} KV blocks, {self.num_free} free")
        free, refs = self._free, self._refs
        plain = min(count, len(free))
        out = [free.popleft() for _ in range(plain)]
        if plain < count:
            evict = self.cache.evict_oldest  # type: ignore[union-attr]
            out += [evict() for _ in range(count - plain)]
        for b in out:
            refs[b] = 1
        return out

    def allocate_one(self) -> int:
        """One fresh block (the hot path: a decoding row crossing a block boundary)."""
        if self._free:
            b = self._free.popleft()
        elif self.cache is not None and self.cache.num_parked:
            b = self.cache.evict_oldest()
        else:
            raise NoFreeBlocks("asked for 1 KV block, 0 free")
        self._refs[b] = 1
        return b

    def acquire(self, block_ids: list[int]) -> None:
        """One more reference to each cached block of a prefix hit, un-parking the free ones."""
        cache, refs = self.cache, self._refs
        if cache is None:
            raise BlockError("acquire() needs a prefix cache")
        for b in block_ids:
            if not cache.is_registered(b):
                raise BlockError(f"block {b} acquired but not cached")
        for b in block_ids:
            if refs[b] == 0:
                cache.unpark(b)
            refs[b] += 1

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each of `block_ids`; a block reaching 0 returns to the free list
        (in table order), or is parked if cached (last block first)."""
        refs, free, cache = self._refs, self._free, self.cache
        parked = []
        for b in block_ids:
            r = refs[b]
            if r <= 0:
                raise BlockError(f"block {b} freed while already free (double free)")
            refs[b] = r - 1
            if r == 1:
                if cache is not None and cache.is_registered(b):
                    parked.append(b)
                else:
                    free.append(b)
        for b in reversed(parked):
            cache.park(b)  # type: ignore[union-attr]

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self, expected_refs: dict[int, int] | None = None) -> None:
        """Raise BlockError unless free + cached + used == total and counts agree with the free
        lists (and, with a cache, the cache's own check: hashes unique, parked == registered free).

        With `expected_refs` (block id -> references held by live sequences, as the scheduler
        recounts them from its block tables), every count must match it exactly.
        """
        free_set = set(self._free)
        if len(free_set) != len(self._free):
            raise BlockError("a block appears twice in the free list")
        if self.cache is not None:
            parked = set(self.cache.parked())
            if parked & free_set:
                raise BlockError(f"blocks {sorted(parked & free_set)} are both free and parked")
            for b in free_set:
                if self.cache.is_registered(b):
                    raise BlockError(f"block {b} is on the plain free list but still cached")
            free_set |= parked
            try:
                self.cache.check_integrity(self._refs)
            except RuntimeError as exc:
                raise BlockError(str(exc)) from None
        for b in range(self.num_blocks):
            r = self._refs[b]
            if r < 0:
                raise BlockError(f"block {b} has negative reference count {r}")
            if (r == 0) != (b in free_set):
                raise BlockError(f"block {b}: ref count {r} but {'in' if b in free_set else 'not in'} free list")
        # NOTE: with the per-block rule above, free + used == total holds by construction.
        if expected_refs is not None:
            for b in range(self.num_blocks):
                want = expected_refs.get(b, 0)
                if self._refs[b] != want:
                    raise BlockError(f"block {b}: ref count {self._refs[b]}, block tables hold {want}")
