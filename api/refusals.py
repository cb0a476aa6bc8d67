"""A worker's refusals at once: the 429 the GPU process would answer, given before the body is read,
parsed, tokenized or submitted (`docs/design.md#admission`).

After every step whose outcome changes it, the GPU process publishes its queue limit and, for the
tenants with over half of it waiting ahead of their next request, that work and the Retry-After a
refusal would carry (`Scheduler.tenants_near_limit`). The worker notes the price the GPU process
gave each tenant's recent requests (admitted or refused, `GpuClient`'s `priced` hook). A request of
tenant T is refused here when the work ahead of T is already past the limit, or would be with
the cheapest of T's last few prices added: the GPU process would refuse it too unless it were
cheaper than anything T sent lately. So a client that retries its refusals at once (hundreds of
streams in a retry storm) costs a worker a header lookup per attempt, not a JSON parse, a chat
template and a tokenizer pass, and its refusals come in milliseconds instead of after the GPU
process's next step. The table is at most one step old; a tenant not in it (nothing much waiting),
or one this worker has no price for, is decided by the GPU process as before.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable

PRICES = 8  # a tenant's last prices kept
TENANTS = 4096  # tenants with prices kept (the least recently priced go first)


class Refusals:
    """`retry_after(tenant)`: Retry-After seconds of a refusal at once, or None (the GPU decides)."""

    __slots__ = ("_sequence", "_read", "_seen", "_limit", "_near", "_prices")

    def __init__(
        self, sequence: Callable[[], int], read: Callable[[], tuple[int, float, dict[str, tuple[int, int]]]]
    ) -> None:
        self._sequence = sequence
        self._read = read
        self._seen = -1
        self._limit = 0.0
        self._near: dict[str, tuple[int, int]] = {}
        self._prices: OrderedDict[str, deque[float]] = OrderedDict()

    def note_price(self, tenant: str, est_ms: float) -> None:
        """The GPU process priced a request of `tenant` at `est_ms` (admitted or refused)."""
        prices = self._prices.get(tenant)
        if prices is None:
            prices = self._prices[tenant] = deque(maxlen=PRICES)
            if len(self._prices) > TENANTS:
                self._prices.popitem(last=False)
        else:
            self._prices.move_to_end(tenant)
        prices.append(est_ms)

    def retry_after(self, tenant: str) -> int | None:
        if self._sequence() != self._seen:  # NOTE: one word read per request; the blob only when it moved
            self._seen, self._limit, self._near = self._read()
        near = self._near.get(tenant)
        if near is None:
            return None
        ahead, retry = near
        prices = self._prices.get(tenant)
        cheapest = min(prices) if prices else None
        if ahead > self._limit or (cheapest is not None and ahead + cheapest > self._limit):
            return retry
        return None
