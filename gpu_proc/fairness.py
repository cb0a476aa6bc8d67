"""Fair queueing across API keys: who joins the batch next.

One FIFO queue per API key. The next admission comes from the waiting key with the fewest
weighted tokens served (a prompt token weighs 1, an output token `output_token_weight`, 12 by
default: it costs 1.25 ms of GPU against 0.1 ms). A key that already holds `key_row_cap` rows
(8) is passed over while another key waits. Declared `max_tokens` plays no part: clients would
under-declare and long requests would starve.

A key that becomes active (nothing running, nothing waiting, then a request) starts from the
smallest count among active keys, not from 0 or its old total: otherwise a key that was idle for
an hour would monopolise the batch until it "caught up", and a key that served a lot an hour ago
would be penalised now (the virtual-token-counter rule of Sheng et al., OSDI '24). Inactive keys
are forgotten, so memory follows the active keys.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from ringserve.gpu_proc.request import Request


@dataclass(slots=True)
class KeyUsage:
    """The seed's per-key record, plus the key's waiting queue."""

    api_key: str
    weighted_tokens_served: float = 0.0
    running_rows: int = 0
    waiting: deque[Request] = field(default_factory=deque)

    @property
    def active(self) -> bool:
        return self.running_rows > 0 or bool(self.waiting)


class FairQueue:
    """Waiting requests of every key, and the served-token accounts that order them."""

    def __init__(self, key_row_cap: int = 8, output_token_weight: float = 12.0) -> None:
        if key_row_cap <= 0:
            raise ValueError(f"key_row_cap must be > 0, got {key_row_cap}")
        if output_token_weight <= 0:
            raise ValueError(f"output_token_weight must be > 0, got {output_token_weight}")
        self.key_row_cap = key_row_cap
        self.output_token_weight = output_token_weight
        self._keys: dict[str, KeyUsage] = {}
        self._waiting_keys: dict[str, KeyUsage] = {}  # keys with a non-empty queue (insertion order)
        self._num_waiting = 0

    def __len__(self) -> int:
        return self._num_waiting

    def usage(self, api_key: str) -> KeyUsage | None:
        return self._keys.get(api_key)

    def keys(self) -> list[KeyUsage]:
        return list(self._keys.values())

    def waiting(self) -> Iterator[Request]:
        for u in self._waiting_keys.values():
            yield from u.waiting

    # -- queue -----------------------------------------------------------------------------------

    def push(self, req: Request) -> None:
        """Queue a new request at the back of its key's queue."""
        u = self._activate(req.tenant)
        u.waiting.append(req)
        self._waiting_keys[req.tenant] = u
        self._num_waiting += 1

    def push_front(self, req: Request) -> None:
        """Queue a preempted request at the front of its key's queue: it goes next for its key."""
        u = self._activate(req.tenant)
        u.waiting.appendleft(req)
        self._waiting_keys[req.tenant] = u
        self._num_waiting += 1

    def remove(self, req: Request) -> bool:
        """Take a waiting request out (cancelled or past its deadline); False if it was not queued."""
        u = self._keys.get(req.tenant)
        if u is None:
            return False
        try:
            u.waiting.remove(req)
        except ValueError:
            return False
        self._num_waiting -= 1
        self._after_dequeue(u)
        return True

    def peek(self) -> Request | None:
        """The request that should join next, or None when nothing waits.

        Among keys with waiting requests: skip keys at the row cap if some key below it waits;
        then fewest weighted tokens served, then fewest running rows, then queue order.
        """
        best: KeyUsage | None = None
        best_rank: tuple[float, int] | None = None
        cap = self.key_row_cap
        if len(self._waiting_keys) == 1:
            return next(iter(self._waiting_keys.values())).waiting[0]
        below_cap = any(u.running_rows < cap for u in self._waiting_keys.values())
        for u in self._waiting_keys.values():
            if below_cap and u.running_rows >= cap:
                continue
            rank = (u.weighted_tokens_served, u.running_rows)
            if best_rank is None or rank < best_rank:
                best, best_rank = u, rank
        return None if best is None else best.waiting[0]

    def pop(self, req: Request) -> None:
        """Remove `req`, which `peek()` just returned, from the head of its key's queue."""
        u = self._keys[req.tenant]
        if not u.waiting or u.waiting[0] is not req:
            raise ValueError(f"request {req.request_id} is not at the head of its key's queue")
        u.waiting.popleft()
        self._num_waiting -= 1
        self._after_dequeue(u)

    # -- accounts --------------------------------------------------------------------------------

    def rows_started(self, api_key: str, rows: int) -> None:
        self._activate(api_key).running_rows += rows

    def rows_ended(self, api_key: str, rows: int) -> None:
        u = self._keys[api_key]
        u.running_rows -= rows
        if u.running_rows < 0:
            raise ValueError(f"key {api_key!r}: running rows went negative")
        if not u.active:
            del self._keys[api_key]

    def charge(self, api_key: str, prompt_tokens: int, output_tokens: int) -> None:
        """Count GPU work done for `api_key`: prompt tokens computed and tokens sampled."""
        u = self._keys.get(api_key)
        if u is not None:
            u.weighted_tokens_served += prompt_tokens + output_tokens * self.output_token_weight

    # -- checks ----------------------------------------------------------------------------------

    def check_integrity(self, running_rows: dict[str, int]) -> None:
        """Raise ValueError unless counts, queues and per-key rows (`running_rows`: key -> rows the
        scheduler's block tables hold) agree."""
        waiting = list(self.waiting())
        if len(waiting) != self._num_waiting:
            raise ValueError(f"queue length {self._num_waiting} but {len(waiting)} requests queued")
        for req in waiting:
            if not req.is_waiting:
                raise ValueError(f"queued {req.key} is in state {req.state.name}")
        for name, u in self._keys.items():
            if not u.active:
                raise ValueError(f"key {name!r} is idle but still tracked")
            if bool(u.waiting) != (name in self._waiting_keys):
                raise ValueError(f"key {name!r}: waiting index disagrees with its queue")
        for name in set(self._keys) | set(running_rows):
            u = self._keys.get(name)
            have = 0 if u is None else u.running_rows
            if have != running_rows.get(name, 0):
                raise ValueError(f"key {name!r}: {have} running rows counted, {running_rows.get(name, 0)} held")

    # -- internals -------------------------------------------------------------------------------

    def _activate(self, api_key: str) -> KeyUsage:
        u = self._keys.get(api_key)
        if u is None:
            floor = min((k.weighted_tokens_served for k in self._keys.values()), default=0.0)
            u = self._keys[api_key] = KeyUsage(api_key, weighted_tokens_served=floor)
        return u

    def _after_dequeue(self, u: KeyUsage) -> None:
        if not u.waiting:
            self._waiting_keys.pop(u.api_key, None)
            if not u.active:
                del self._keys[u.api_key]
