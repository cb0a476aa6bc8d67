"""Prefix cache: which full KV blocks hold which token prefixes, and the LRU of cached free blocks.

A *full* block is named by a hash chained from its parent's hash and its own token ids; the chain
starts from a root hash of the model namespace and the request's `cache_salt`, so two tenants with
different salts never share a block. Only full blocks are registered: a block still being written
is never found, so no sequence can append into a block another sequence reads.

A registered block stays registered while sequences use it and after its last reference is
dropped: it is then *parked* in least-recently-used order (still counted as free). The block
manager hands out unregistered free blocks first and only then evicts the oldest parked block,
which forgets its hash.

Collision safety: a hash hit is only a hint. Every registered block also records its exact token
ids and the *serial number* of the node it extends (serials are never reused, unlike block ids or
hashes), and a lookup walks the chain from the root comparing both. Two different prefixes can
therefore share a hash and still never share a block; the tests inject a constant hash function.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ringserve.gpu_proc.request import Request

HashFn = Callable[[int, Hashable], int]
RootKey = tuple[str, str | None]  # ("root", salt): the parent of every chain's first block


def chain_hash(parent: int, tokens: Hashable) -> int:
    """Default link hash: Python's tuple hash (deterministic for ints within one process, which
    is all the cache needs; collisions only cost a miss, see the module docstring)."""
    return hash((parent, tokens))


class PrefixCacheError(RuntimeError):
    """The cache's books disagree with themselves or the block manager: a bookkeeping bug."""


@dataclass(slots=True)
class CachedBlock:
    """What a registered block holds: its chain hash, its node serial, its parent node and tokens."""

    hash: int
    serial: int
    parent: int | RootKey  # the parent's serial, or the root key for a chain's first block
    tokens: tuple[int, ...]


class PrefixCache:
    """Hash chain index over full KV blocks plus the LRU of parked (cached, unreferenced) blocks."""

    __slots__ = (
        "num_blocks",
        "block_size",
        "namespace",
        "_hash_fn",
        "_by_hash",
        "_entries",
        "_lru",
        "_next_serial",
        "queries",
        "hits",
    )

    def __init__(self, num_blocks: int, block_size: int, *, namespace: str = "", hash_fn: HashFn = chain_hash) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need num_blocks > 0 and block_size > 0, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.namespace = namespace  # the model: a cache never outlives its process's one model
        self._hash_fn = hash_fn
        self._by_hash: dict[int, int] = {}
        self._entries: list[CachedBlock | None] = [None] * num_blocks
        self._lru: OrderedDict[int, None] = OrderedDict()  # parked blocks, oldest first
        self._next_serial = 0
        self.queries = 0  # tokens looked up when requests join (the vLLM metric's unit)
        self.hits = 0  # of those, tokens found cached

    # -- hashing ---------------------------------------------------------------------------------

    def root_hash(self, salt: str | None) -> int:
        return self._hash_fn(0, ("root", self.namespace, salt))

    def link_hash(self, parent: int, tokens: tuple[int, ...]) -> int:
        """The chain hash of a block holding `tokens` after the block hashed `parent`."""
        return self._hash_fn(parent, tokens)

    def extend_hashes(
        self, hashes: list[int], tokens: Callable[[int, int], Sequence[int]], num_blocks: int, salt: str | None
    ) -> list[int]:
        """Grow `hashes` (a sequence's chain hashes, one per full block) to `num_blocks` entries;
        `tokens(start, end)` returns the sequence's token ids in that range. Returns `hashes`."""
        bs, fn = self.block_size, self._hash_fn
        parent = hashes[-1] if hashes else self.root_hash(salt)
        for j in range(len(hashes), num_blocks):
            parent = fn(parent, tuple(tokens(j * bs, (j + 1) * bs)))
            hashes.append(parent)
        return hashes

    # -- lookup and registration -----------------------------------------------------------------

    def match(self, hashes: Sequence[int], tokens: Callable[[int, int], Sequence[int]], salt: str | None) -> list[int]:
        """Block ids of the longest cached run of the chain `hashes`, verified token by token."""
        bs = self.block_size
        out: list[int] = []
        parent: int | RootKey = ("root", salt)
        for j, h in enumerate(hashes):
            b = self._by_hash.get(h)
            if b is None:
                break
            e = self._entries[b]
            if e is None or e.parent != parent or e.tokens != tuple(tokens(j * bs, (j + 1) * bs)):
                break  # NOTE: a hash collision (or a stale chain) — never serve these keys
            out.append(b)
            parent = e.serial
        return out

    def register(
        self, block: int, block_hash: int, tokens: Sequence[int], parent_block: int | None, salt: str | None
    ) -> bool:
        """Name the just-filled `block` (its parent is the previous block of the same table, or
        None for a chain's first block). False, and nothing registered, when the hash is already
        taken (the same prefix computed twice, or a collision), the block is already registered,
        or the parent is not registered (its chain cannot be verified)."""
        if len(tokens) != self.block_size:
            raise ValueError(f"only full blocks are cached: got {len(tokens)} tokens for {self.block_size}")
        if block_hash in self._by_hash or self._entries[block] is not None:
            return False
        if parent_block is None:
            parent: int | RootKey = ("root", salt)
        else:
            pe = self._entries[parent_block]
            if pe is None:
                return False
            parent = pe.serial
        self._next_serial += 1
        self._entries[block] = CachedBlock(
            block_hash, self._next_serial, parent, tokens if type(tokens) is tuple else tuple(tokens)
        )
        self._by_hash[block_hash] = block
        return True

    def unregister(self, block: int) -> None:
        """Forget an in-use block's name: its last token is to be written again (a paused row)."""
        e = self._entries[block]
        if e is None:
            return
        if block in self._lru:
            raise PrefixCacheError(f"block {block} unregistered while parked")
        del self._by_hash[e.hash]
        self._entries[block] = None

    def is_registered(self, block: int) -> bool:
        return self._entries[block] is not None

    def entry(self, block: int) -> CachedBlock | None:
        return self._entries[block]

    # -- the parked LRU --------------------------------------------------------------------------

    @property
    def num_parked(self) -> int:
        return len(self._lru)

    @property
    def num_registered(self) -> int:
        return len(self._by_hash)

    def parked(self) -> list[int]:
        """Parked block ids, next to be evicted first."""
        return list(self._lru)

    def park(self, block: int) -> None:
        """A registered block's last reference is gone: it becomes the most recently used."""
        if self._entries[block] is None:
            raise PrefixCacheError(f"block {block} parked but not registered")
        self._lru[block] = None

    def unpark(self, block: int) -> None:
        """A parked block was hit: it is in use again."""
        del self._lru[block]

    def evict_oldest(self) -> int:
        """Take the least recently used parked block and forget its hash; the caller reuses it."""
        block, _ = self._lru.popitem(last=False)
        e = self._entries[block]
        del self._by_hash[e.hash]  # type: ignore[union-attr]
        self._entries[block] = None
        return block

    def record(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self, refs: Sequence[int]) -> None:
        """Raise PrefixCacheError unless hashes map one-to-one onto registered blocks, every parked
        block is registered with no references, and every registered unreferenced block is parked."""
        registered = 0
        for b, e in enumerate(self._entries):
            if e is None:
                if b in self._lru:
                    raise PrefixCacheError(f"block {b} is parked but not registered")
                continue
            registered += 1
            if self._by_hash.get(e.hash) != b:
                raise PrefixCacheError(f"block {b}: hash {e.hash:#x} maps to {self._by_hash.get(e.hash)}")
            if len(e.tokens) != self.block_size:
                raise PrefixCacheError(f"block {b} registered with {len(e.tokens)} tokens")
            if (refs[b] == 0) != (b in self._lru):
                raise PrefixCacheError(f"block {b}: ref count {refs[b]} but {'' if b in self._lru else 'not '}parked")
        if registered != len(self._by_hash):
            raise PrefixCacheError(f"{len(self._by_hash)} hashes for {registered} registered blocks (not unique)")


# -- the KV manager's two uses: a joining request's hits, and the blocks a step fills --------------


def cached_prefix(cache: PrefixCache, req: Request) -> list[int]:
    """Cached blocks for `req`'s leading full blocks, short of its last token (which must be
    computed so the request samples)."""
    limit = (req.num_tokens - 1) // cache.block_size
    hashes = req.block_hashes
    if len(hashes) < limit:
        cache.extend_hashes(hashes, req.tokens, limit, req.cache_salt)
    return cache.match(hashes[:limit], req.tokens, req.cache_salt)


def register_filled(cache: PrefixCache, filled: list[tuple[Request, int, int]]) -> None:
    """Register every block a step fills up: `filled` holds each request with the token range
    `[start, end)` the step computes for it. NOTE: safe before the step runs, since a later request
    can read a registered block only in a later step, after these writes."""
    bs = cache.block_size
    for req, start, end in filled:
        first, last = start // bs, end // bs
        hashes, tokens, salt = req.block_hashes, req.tokens, req.cache_salt
        if len(hashes) < first:
            cache.extend_hashes(hashes, tokens, first, salt)
        table = req.block_ids
        for j in range(first, last):
            block_tokens = tuple(tokens(j * bs, (j + 1) * bs))  # one tuple for the hash and the entry
            if len(hashes) == j:
                hashes.append(cache.link_hash(hashes[-1] if j else cache.root_hash(salt), block_tokens))
            cache.register(table[j], hashes[j], block_tokens, table[j - 1] if j else None, salt)
