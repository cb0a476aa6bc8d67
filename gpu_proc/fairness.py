"""Fair queueing across tenants (API key owners): who joins the batch next, and who gives a row
back when a tenant below its share has waited too long (`docs/design.md#fairness`).

One FIFO queue per tenant. The next admission comes from the waiting tenant that ranks first by
  1. rows held below `tenant_row_cap` (8): a tenant at the cap is passed over while another waits;
  2. rows held below its fair share, `max_rows / active tenants` (a fraction: with 32 rows and
     3 tenants, 10 rows is below it and 11 is not): max-min fairness of the batch;
  3. fewest weighted tokens served (a prompt token weighs 1, an output token
     `output_token_weight`, 12 by default: it costs 1.25 ms of GPU against 0.1 ms);
  4. fewest rows held, then queue order.
Declared `max_tokens` plays no part: clients would under-declare and long requests would starve.

Rows only free when requests end, so ordering alone cannot help a tenant whose rows are all held by
another (a flood admitted together ends together). `preemptable_for(tenant)`, for a tenant below
its share, names the tenant to take a row from: the one holding the most rows, when it is over its
share and keeps at least as many rows as the waiting tenant will have. The second condition makes
a move never undo itself, so fair preemption cannot ping-pong between two tenants, and the rows
settle where no two tenants differ by more than one (32 rows, 3 tenants: 11, 11, 10).

A tenant that becomes active (nothing running, nothing waiting, then a request) starts from the
smallest count among active tenants, not from 0 or its old total: otherwise a tenant idle for an
hour would monopolise the batch until it "caught up", and one that was served a lot an hour ago
would be penalised now (the virtual-token-counter rule of Sheng et al., OSDI '24). Inactive tenants
are forgotten, so memory follows the active ones.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from ringserve.gpu_proc.request import Request

# How deep `peek(skip=...)` looks into a tenant's queue: skipping costs a scan per admission, and a
# tenant whose first 64 requests all wait simply waits.
SKIP_DEPTH = 64


def _first(waiting: deque[Request], skip: Callable[[Request], bool]) -> Request | None:
    return next((r for r in itertools.islice(waiting, SKIP_DEPTH) if not skip(r)), None)


@dataclass(slots=True)
class TenantUsage:
    """One tenant's account (`docs/design.md#fairness`), plus its waiting queue."""

    tenant: str
    weighted_tokens_served: float = 0.0
    running_rows: int = 0
    waiting: deque[Request] = field(default_factory=deque)

    @property
    def active(self) -> bool:
        return self.running_rows > 0 or bool(self.waiting)


class FairQueue:
    """Waiting requests of every tenant, and the accounts that order them."""

    def __init__(self, tenant_row_cap: int = 8, output_token_weight: float = 12.0, max_rows: int | None = None) -> None:
        """`max_rows` (the batch's rows) enables fair shares; None orders by cap and tokens only."""
        if tenant_row_cap <= 0:
            raise ValueError(f"tenant_row_cap must be > 0, got {tenant_row_cap}")
        if output_token_weight <= 0:
            raise ValueError(f"output_token_weight must be > 0, got {output_token_weight}")
        self.tenant_row_cap = tenant_row_cap
        self.output_token_weight = output_token_weight
        self.max_rows = max_rows
        self._tenants: dict[str, TenantUsage] = {}
        self._waiting_tenants: dict[str, TenantUsage] = {}  # tenants with a non-empty queue
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def usage(self, tenant: str) -> TenantUsage | None:
        return self._tenants.get(tenant)

    def tenants(self) -> list[TenantUsage]:
        return list(self._tenants.values())

    def waiting(self) -> Iterator[Request]:
        for u in self._waiting_tenants.values():
            yield from u.waiting

    @property
    def share(self) -> float:
        """Each active tenant's fair share of the batch's rows."""
        if self.max_rows is None or not self._tenants:
            return float("inf")
        return self.max_rows / len(self._tenants)

    # -- queue -----------------------------------------------------------------------------------

    def push(self, req: Request) -> None:
        """Queue a new request at the back of its tenant's queue."""
        u = self._activate(req.tenant)
        u.waiting.append(req)
        self._waiting_tenants[req.tenant] = u
        self._num_waiting += 1

    def push_front(self, req: Request) -> None:
        """Queue a request at the front of its tenant's queue (preempted, or a sibling of one that
        already started): it goes next for its tenant."""
        u = self._activate(req.tenant)
        u.waiting.appendleft(req)
        self._waiting_tenants[req.tenant] = u
        self._num_waiting += 1

    def remove(self, req: Request) -> bool:
        """Take a waiting request out (cancelled or past its deadline); False if it was not queued."""
        u = self._tenants.get(req.tenant)
        if u is None:
            return False
        try:
            u.waiting.remove(req)
        except ValueError:
            return False
        self._num_waiting -= 1
        self._after_dequeue(u)
        return True

    def peek(self, skip: Callable[[Request], bool] | None = None) -> Request | None:
        """The request that should join next (see the module docstring), or None. With `skip`, each
        tenant offers its first request that `skip` passes over not (among its first `SKIP_DEPTH`):
        the scheduler's way past requests that cannot join yet (a LoRA adapter without a slot)."""
        waiting = self._waiting_tenants
        if skip is None and len(waiting) == 1:
            return next(iter(waiting.values())).waiting[0]
        cap, share = self.tenant_row_cap, self.share
        best: Request | None = None
        best_rank: tuple | None = None
        for u in waiting.values():
            first = u.waiting[0] if skip is None else _first(u.waiting, skip)
            if first is None:
                continue
            rows = u.running_rows
            rank = (rows >= cap, rows >= share, u.weighted_tokens_served, rows)
            if best_rank is None or rank < best_rank:
                best, best_rank = first, rank
        return best

    def pop(self, req: Request) -> None:
        """Remove `req`, which `peek()` just returned, from its tenant's queue (the head, unless
        `peek` skipped some)."""
        u = self._tenants[req.tenant]
        if u.waiting and u.waiting[0] is req:
            u.waiting.popleft()
        elif req in itertools.islice(u.waiting, SKIP_DEPTH):
            u.waiting.remove(req)
        else:
            raise ValueError(f"request {req.request_id} is not among the first of its tenant's queue")
        self._num_waiting -= 1
        self._after_dequeue(u)

    def preemptable_for(self, tenant: str) -> str | None:
        """The tenant to take one row from so `tenant` can start a request, or None when `tenant`
        is not below its fair share or nobody holds more than theirs (see the module docstring)."""
        u = self._tenants.get(tenant)
        share = self.share
        if u is None or u.running_rows >= share:
            return None
        victim = max(
            (v for v in self._tenants.values() if v.tenant != tenant), key=lambda v: v.running_rows, default=None
        )
        if victim is None or victim.running_rows <= share or victim.running_rows < u.running_rows + 2:
            return None
        return victim.tenant

    # -- accounts --------------------------------------------------------------------------------

    def rows_started(self, tenant: str, rows: int) -> None:
        self._activate(tenant).running_rows += rows

    def rows_ended(self, tenant: str, rows: int) -> None:
        u = self._tenants[tenant]
        u.running_rows -= rows
        if u.running_rows < 0:
            raise ValueError(f"tenant {tenant!r}: running rows went negative")
        if not u.active:
            del self._tenants[tenant]

    def charge(self, tenant: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count GPU work done for `tenant`: prompt tokens computed and tokens sampled."""
        u = self._tenants.get(tenant)
        if u is not None:
            u.weighted_tokens_served += prompt_tokens + output_tokens * self.output_token_weight

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self, running_rows: dict[str, int]) -> None:
        """Raise ValueError unless counts, queues and per-tenant rows (`running_rows`: tenant ->
        rows the scheduler's block tables hold) agree."""
        waiting = list(self.waiting())
        if len(waiting) != self._num_waiting:
            raise ValueError(f"queue length {self._num_waiting} but {len(waiting)} requests queued")
        for req in waiting:
            if not req.is_waiting:
                raise ValueError(f"queued {req.key}#{req.index} is in state {req.state.name}")
        for name, u in self._tenants.items():
            if not u.active:
                raise ValueError(f"tenant {name!r} is idle but still tracked")
            if bool(u.waiting) != (name in self._waiting_tenants):
                raise ValueError(f"tenant {name!r}: waiting index disagrees with its queue")
        for name in set(self._tenants) | set(running_rows):
            held = self._tenants.get(name)
            have = 0 if held is None else held.running_rows
            if have != running_rows.get(name, 0):
                raise ValueError(f"tenant {name!r}: {have} running rows counted, {running_rows.get(name, 0)} held")

    # -- internals -------------------------------------------------------------------------------

    def _activate(self, tenant: str) -> TenantUsage:
        u = self._tenants.get(tenant)
        if u is None:
            floor = min((t.weighted_tokens_served for t in self._tenants.values()), default=0.0)
            u = self._tenants[tenant] = TenantUsage(tenant, weighted_tokens_served=floor)
        return u

    def _after_dequeue(self, u: TenantUsage) -> None:
        if not u.waiting:
            self._waiting_tenants.pop(u.tenant, None)
            if not u.active:
                del self._tenants[u.tenant]
