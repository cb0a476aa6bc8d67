"""The KV cache manager: a request's blocks behind a few verbs (`docs/design.md#kv-cache`), as
vLLM v1's `KVCacheManager` hides them.

    kv.join(req, reserve)               # prefix hits + blocks for its current tokens, or False
    kv.allocate_slots(req, n)           # slots for its next n tokens (a decode token, a chunk), or None
    kv.allocate_draft_slots(req, n)     # slots for n speculative tokens after those, never registered
    kv.accept_draft(req, start)         # a verified draft: register what it kept, free what it did not
    kv.uncompute(req)                   # a paused row's last token is computed again
    kv.commit()                         # blocks this step fills become findable (end of the build)
    kv.free(req)                        # every reference it holds
    kv.fits(n, tokens, reserve)         # would n such requests join now?  kv.fits_pool(...), kv.stats()

The scheduler decides who gets blocks (budget, preemption, fairness); this decides which blocks and
does the counting, so the scheduler never sees a block size: a hit on a block another request holds
costs nothing, a hit on a parked block uses up a free one (`docs/design.md#prefix-cache`).

Registration: `allocate_slots` notes the blocks its tokens will fill, and `commit()` registers them
once the step is built (its writes land before any later step reads them). A request freed in
between (preempted while the step was being built) registers nothing: its blocks were never written.
Draft tokens (speculative decoding, `speculation.py`) are not noted: their slots may hold rejected
guesses. Once the step is verified, `accept_draft` registers the full blocks the accepted tokens
filled and returns the blocks that only rejected tokens reached, so a block is never found in the
cache unless every token in it is the request's own, and a rejected draft leaks nothing.

The prefix cache is used for a request when the config turns caching on, and always for the
siblings of an n > 1 request (never read for one owed prompt logprobs), which share their prompt's
blocks through it. With caching off, siblings hash under a salt of their own, so no other request
finds their blocks, and those lookups are not counted in the cache's metrics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.prefix_cache import PrefixCache, cached_prefix, register_filled
from ringserve.gpu_proc.request import Request


@dataclass(frozen=True, slots=True)
class KVStats:
    """The pool's state as the GPU process publishes it."""

    free: int  # blocks an allocation can take (parked cached ones included)
    total: int
    cached: int  # free blocks still holding a cached prefix
    queries: int  # tokens looked up in the prefix cache at each join
    hits: int  # of those, tokens served from cached blocks


class KVCacheManager:
    """Request-level KV blocks over a `BlockManager`, with its prefix cache."""

    __slots__ = ("bm", "cache", "block_size", "caching", "_pending")

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
        self._pending: dict[Request, tuple[int, int]] = {}  # token range whose full blocks fill this step

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return self.bm.num_free

    @property
    def num_blocks(self) -> int:
        return self.bm.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.bm.blocks_for(num_tokens)

    def margin(self, share: float) -> int:
        """Blocks that are `share` of the pool, rounded up (the admission margin)."""
        return math.ceil(share * self.bm.num_blocks)

    def fits(self, n: int, num_tokens: int, reserve: int = 0, reserved: int = 0) -> bool:
        """Whether `n` requests of `num_tokens` tokens each (without cache hits) would find their
        blocks free, plus `reserve`, after the `reserved` blocks promised to others."""
        return reserved + n * self.bm.blocks_for(num_tokens) + reserve <= self.bm.num_free

    def fits_pool(self, prompt_len: int, max_tokens: int, n: int) -> bool:
        """Whether `n` samples of a prompt could ever be held at once: the prompt's full blocks
        (shared) once, then each sample's own tail up to the context it may reach."""
        full = prompt_len // self.block_size
        return full + n * (self.bm.blocks_for(prompt_len + max_tokens) - full) <= self.bm.num_blocks

    def has_shared_prefix(self, prompt_len: int) -> bool:
        """Whether a prompt this long fills a block that siblings could share."""
        return prompt_len >= self.block_size

    def prompt_registered(self, req: Request) -> bool:
        """Every full block of `req`'s prompt is registered (its step has been built)."""
        full = req.prompt_len // self.block_size * self.block_size
        return req.is_finished or req.num_computed >= full

    def uses_cache(self, req: Request) -> bool:
        return self.caching or req.n > 1

    def stats(self) -> KVStats:
        bm, cache = self.bm, self.cache
        return KVStats(bm.num_free, bm.num_blocks, bm.num_cached, cache.queries, cache.hits)

    # -- verbs -----------------------------------------------------------------------------------

    def join(self, req: Request, reserve: int = 0) -> bool:
        """Start `req`'s table: the cached blocks of its leading full blocks by reference (none
        while it reads every prompt position: a cached block keeps no logits or hidden states),
        then fresh blocks for the rest of its current tokens, with `num_computed` past the hits.
        False, with nothing taken, when fewer than those blocks plus `reserve` are free."""
        if req.block_ids:
            raise ValueError(f"{req.key}#{req.index} joins with blocks already")
        hits = cached_prefix(self.cache, req) if self.uses_cache(req) and not req.reads_every_position else []
        bm = self.bm
        need = bm.blocks_for(req.num_tokens)
        taken = need - sum(1 for b in hits if bm.ref_count(b))  # a hit in use costs no free block
        if bm.num_free < taken + reserve:
            return False
        if hits:
            bm.acquire(hits)
            req.block_ids += hits
        req.num_computed = len(hits) * self.block_size
        if self.caching and not req.reads_every_position:
            self.cache.record(req.num_tokens, req.num_computed)
        self._grow(req.block_ids, need - len(hits))
        return True

    def allocate_slots(self, req: Request, num_new_tokens: int) -> list[int] | None:
        """Slots for `req`'s next `num_new_tokens` tokens (from `num_computed`), growing its table
        as needed, and note the blocks they fill for `commit()`. None, with nothing taken, when
        too few blocks are free."""
        table = req.block_ids
        start = req.num_computed
        end = start + num_new_tokens
        need = self.bm.blocks_for(end) - len(table)
        if need > 0:
            if self.bm.num_free < need:
                return None
            self._grow(table, need)
        if end // self.block_size > start // self.block_size and self.uses_cache(req):
            self._pending[req] = (start, end)
        return table

    def allocate_draft_slots(self, req: Request, num_draft: int, reserve: int = 0) -> bool:
        """Slots for `num_draft` draft tokens from `req.num_computed` on, growing its table; never
        noted for registration. False, with nothing taken, unless `reserve` blocks stay free
        after (a draft is optional: it never takes the admission margin, never preempts)."""
        need = self.bm.blocks_for(req.num_computed + num_draft) - len(req.block_ids)
        if need > 0:
            if self.bm.num_free < need + reserve:
                return False
            self._grow(req.block_ids, need)
        return True

    def accept_draft(self, req: Request, draft_start: int) -> None:
        """The step verified `req`'s draft, which began at token `draft_start`, and kept the tokens up
        to `req.num_computed` (the scheduler has rolled it back and appended them): register the
        full blocks they filled, and free the blocks past those its `num_tokens` need."""
        end = req.num_computed
        if end // self.block_size > draft_start // self.block_size and self.uses_cache(req):
            register_filled(self.cache, [(req, draft_start, end)])  # NOTE: their writes have landed
        keep = self.bm.blocks_for(req.num_tokens)
        table = req.block_ids
        if len(table) > keep:
            self.bm.free(table[keep:])
            del table[keep:]

    def uncompute(self, req: Request) -> None:
        """The scheduler moved `req.num_computed` back (a paused row: its last token is computed
        again): the block that token completed, registered when the step was built, is forgotten
        again (no other request can have found it yet, and it will be written again), and blocks
        past `req`'s tokens (a paused draft's) are freed."""
        self._pending.pop(req, None)
        at = req.num_computed // self.block_size
        table = req.block_ids
        if at < len(table) and self.cache.is_registered(table[at]):
            self.cache.unregister(table[at])
        keep = self.bm.blocks_for(req.num_tokens)
        if len(table) > keep:
            self.bm.free(table[keep:])
            del table[keep:]

    def commit(self) -> None:
        """Register the full blocks the step being built fills (see the module docstring)."""
        if self._pending:
            register_filled(self.cache, [(req, start, end) for req, (start, end) in self._pending.items()])
            self._pending.clear()

    def free(self, req: Request) -> None:
        """Drop every reference `req` holds; its table is empty afterwards."""
        self._pending.pop(req, None)
        if req.block_ids:
            self.bm.free(req.block_ids)
            req.block_ids = []

    def _grow(self, table: list[int], count: int) -> None:
        if count == 1:
            table.append(self.bm.allocate_one())
        elif count > 0:
            table += self.bm.allocate(count)
