"""The KV cache manager: a request's blocks behind a few verbs (`docs/design.md#kv-cache`).

    hits = kv.lookup(req)                                      # cached blocks for its leading full blocks
    table = kv.allocate_slots(req, n_tokens, hits, reserve)    # cover n_tokens slots, or None (nothing taken)
    kv.free(req)                                               # every reference it holds
    kv.register_filled(filled)                                 # blocks a step fills become findable

The scheduler decides who gets blocks (budget, preemption, fairness); this decides which blocks and
does the counting: a hit on a block another request holds costs nothing, a hit on a parked block
uses up a free one (`docs/design.md#prefix-cache`).

The prefix cache is used for a request when the config turns caching on, and always for the
siblings of an n > 1 request (but never read for one owed prompt logprobs), which share their prompt's blocks through it. With caching off, the
scheduler gives each sibling group a salt of its own, so no other request finds its blocks, and
those lookups are not counted in the cache's metrics.
"""

from __future__ import annotations

from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.prefix_cache import PrefixCache, cached_prefix, register_filled
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.step import SeqStep


class KVCacheManager:
    """Request-level KV blocks over a `BlockManager`, with its prefix cache."""

    __slots__ = ("bm", "cache", "block_size", "caching")

    def __init__(self, block_manager: BlockManager, *, caching: bool, namespace: str = "") -> None:
        """Attaches a `PrefixCache` to the fresh `block_manager` unless it has one (tests attach
        their own, e.g. with a colliding hash); `caching` is the config's `prefix_caching`."""
        if block_manager.cache is None:
            block_manager.attach_cache(
                PrefixCache(block_manager.num_blocks, block_manager.block_size, namespace=namespace)
            )
        self.bm = block_manager
        self.cache: PrefixCache = block_manager.cache  # type: ignore[assignment]
        self.block_size = block_manager.block_size
        self.caching = caching

    @property
    def num_free(self) -> int:
        return self.bm.num_free

    def blocks_for(self, num_tokens: int) -> int:
        return self.bm.blocks_for(num_tokens)

    def uses_cache(self, req: Request) -> bool:
        return self.caching or req.n > 1

    def lookup(self, req: Request) -> list[int]:
        """Cached blocks `req` can start from (none when the cache is not used for it, or while it
        is owed prompt logprobs: a cached block has no logits)."""
        return cached_prefix(self.cache, req) if self.uses_cache(req) and not req.scores_prompt else []

    def allocate_slots(
        self, req: Request, n_tokens: int, hits: list[int] | None = None, reserve: int = 0
    ) -> list[int] | None:
        """Grow `req.block_ids` to cover `n_tokens` token slots and return it, or return None and
        change nothing when fewer than the blocks it takes plus `reserve` are free. `hits` (from
        `lookup`, for an empty table only) start the table by reference; `num_computed` then
        starts past them."""
        table = req.block_ids
        need = -(-n_tokens // self.block_size) - len(table)
        if need <= 0:
            return table
        hits = hits or []
        if hits and table:
            raise ValueError(f"{req.key}#{req.index}: prefix hits for a table that already has blocks")
        bm = self.bm
        taken = need - sum(1 for b in hits if bm.ref_count(b))  # a hit in use costs no free block
        if bm.num_free < taken + reserve:
            return None
        if not table:
            if hits:
                bm.acquire(hits)
                table += hits
            req.num_computed = len(hits) * self.block_size
            if self.caching and not req.scores_prompt:  # a request that scores its prompt looks nothing up
                self.cache.record(n_tokens, req.num_computed)
        fresh = need - len(hits)
        if fresh == 1:
            table.append(bm.allocate_one())
        elif fresh:
            table += bm.allocate(fresh)
        return table

    def free(self, req: Request) -> None:
        """Drop every reference `req` holds; its table is empty afterwards."""
        if req.block_ids:
            self.bm.free(req.block_ids)
            req.block_ids = []

    def register_filled(self, filled: list[tuple[SeqStep, Request]]) -> None:
        """Make the full blocks a step fills findable by later lookups (requests using the cache)."""
        if not self.caching:
            filled = [f for f in filled if f[1].n > 1]
        if filled:
            register_filled(self.cache, filled)
