"""n > 1 as sibling requests (`docs/design.md#sampling`), as vLLM v1 fans out parallel sampling.

A Submit with `n` samples becomes `n` requests sharing its (worker, rid), prompt and seed; each has
its own sample index (so its own seed stream), blocks and cancel. They share the prompt's KV blocks
through the prefix cache: sample 0 is queued at once, the others are held until its prompt's full
blocks are registered (the step that fills them has been built), then queued first for their
tenant, so they join at a later pass and find those blocks cached. The cache is used for siblings
even when the config turns caching off; they then hash under a salt of their own, so no other
request shares their blocks.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from ringserve.gpu_proc.request import Request, WorkerRid
from ringserve.gpu_proc.step import RowControls, RowSampling

if TYPE_CHECKING:
    from ringserve.gpu_proc.kv_manager import KVCacheManager


class Siblings:
    """The fan-out, and the samples held until their sample 0's prompt blocks are registered."""

    __slots__ = ("kv", "caching", "_held", "_groups")

    def __init__(self, kv: KVCacheManager, caching: bool) -> None:
        self.kv = kv
        self.caching = caching  # the config's prefix_caching
        self._held: dict[WorkerRid, list[Request]] = {}
        self._groups = 0

    def fan_out(self, req: Request, seed: int, seq_ids: Iterator[int]) -> list[Request]:
        """`req` (sample 0) and its n - 1 siblings, each with its own sampling index and seq id."""
        samples = [req] + [req.sibling(i) for i in range(1, req.n)]
        if req.n > 1 and not self.caching:
            self._groups += 1
            salt = f"{req.cache_salt or ''}\x00siblings-{self._groups}"
            for s in samples:
                s.cache_salt = salt
        sp = req.sampling
        for s in samples:
            controls = RowControls(sp, s.prompt_ids, s.generated) if sp.controlled else None
            s.row_sampling = RowSampling(sp.temperature, sp.top_k, sp.top_p, seed, s.index, req.logprobs, controls)
            s.seq_id = next(seq_ids)
        return samples

    def hold(self, samples: list[Request]) -> list[Request]:
        """The samples to queue now: all when the prompt has no full block to share, else sample 0
        (the others are held)."""
        if len(samples) == 1 or not self.kv.has_shared_prefix(samples[0].prompt_len):
            return samples
        self._held[samples[0].key] = samples[1:]
        return samples[:1]

    def ready(self, live: dict[WorkerRid, list[Request]]) -> list[Request]:
        """Held samples whose sample 0 has its prompt's full blocks registered (or has ended), in
        index order; they are no longer held."""
        out: list[Request] = []
        for key in [k for k, _ in self._held.items() if self.kv.prompt_registered(live[k][0])]:
            out += self._held.pop(key)
        return out

    def release(self, first: Request) -> list[Request]:
        """Sample 0 ended: its held siblings, to compute the prompt themselves."""
        return self._held.pop(first.key, [])

    def discard(self, req: Request) -> bool:
        """Forget a held sample that ended before it was queued; False if it was not held."""
        held = self._held.get(req.key)
        if not held or req not in held:
            return False
        held.remove(req)
        if not held:
            del self._held[req.key]
        return True

    def rows_reserved(self, live: dict[WorkerRid, list[Request]]) -> int:
        """Rows the held samples of a running sample 0 will take at a coming pass: kept free."""
        return sum(len(h) for key, h in self._held.items() if live[key][0].is_running)

    def is_held(self, req: Request) -> bool:
        return req in self._held.get(req.key, ())

    def __bool__(self) -> bool:
        return bool(self._held)

    def __len__(self) -> int:
        return sum(len(h) for h in self._held.values())

    def __iter__(self) -> Iterator[Request]:
        for held in self._held.values():
            yield from held
