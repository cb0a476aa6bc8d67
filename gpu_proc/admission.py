"""Admission control: the price of a request and the 400/429 decisions.

`est_gpu_ms = prompt_tokens * c_prefill + n * expected_output * c_decode`, where the expected
output is min(max_tokens, the recent average answer length), and at least what the request is sure
to generate (`floor_tokens`: all of max_tokens with EOS ignored and no stop ids). The constants start
at 0.1 ms per prompt token and 1.25 ms per output token (a 40 ms step shared by 32 rows) and follow
measured step times (`cost_model.py`), so the "2 s of waiting GPU work" limit means 2 s on this
hardware (`docs/design.md#admission`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringserve.gpu_proc.cost_model import AnswerLengths, CostModel
from ringserve.rules import CONTEXT_LENGTH_EXCEEDED, context_error

if TYPE_CHECKING:
    from ringserve.gpu_proc.request import Request

# NOTE: the openai and httpx-based clients ignore a Retry-After over 60 s and fall back to their own
# short backoff, so a longer projection would bring retries sooner, not later; a client retrying
# after 60 s gets a fresh projection.
RETRY_AFTER_MAX_S = 60


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one submit: accepted with its estimate, or an HTTP status with a message."""

    status: int  # 200 accepted | 400 | 429
    est_gpu_ms: float = 0.0
    code: str = ""
    message: str = ""
    retry_after_s: float | None = None

    @property
    def accepted(self) -> bool:
        return self.status == 200


class AdmissionController:
    """Decides 400 / 429 / accept for a request and prices it in GPU milliseconds."""

    def __init__(
        self,
        *,
        context_limit: int = 8192,
        max_tokens_limit: int = 0,
        max_rows: int = 32,
        queue_limit_s: float = 2.0,
        c_prefill_ms: float = 0.1,
        c_decode_ms: float = 1.25,
        initial_answer_tokens: float = 300.0,
    ) -> None:
        if queue_limit_s <= 0:
            raise ValueError(f"queue_limit_s must be > 0, got {queue_limit_s}")
        self.context_limit = context_limit
        self.max_tokens_limit = max_tokens_limit
        self.max_rows = max_rows
        self.queue_limit_ms = queue_limit_s * 1000.0
        self.costs = CostModel(c_prefill_ms, c_decode_ms, max_rows=max_rows)
        self.answers = AnswerLengths(initial_answer_tokens, cap=context_limit)

    @classmethod
    def from_config(cls, config) -> AdmissionController:
        """Build from a `ringserve.config.Config` (duck-typed: any object with its field names)."""
        return cls(
            context_limit=config.context_limit,
            max_tokens_limit=config.max_tokens_limit,
            max_rows=config.max_rows,
            queue_limit_s=config.queue_limit_s,
            c_prefill_ms=config.c_prefill_ms,
            c_decode_ms=config.c_decode_ms,
        )

    def estimate_ms(
        self, prompt_tokens: int, max_tokens: int, n: int = 1, generated: int = 0, floor_tokens: int = 0
    ) -> float:
        """GPU ms still owed to a request that has `generated` tokens per row so far and will
        generate at least `floor_tokens` per row (so a flood of short answers cannot make a request
        that must run to max_tokens look cheap)."""
        expected = max(min(max_tokens, max(self.answers.mean, floor_tokens)) - generated, 0.0)
        return (prompt_tokens + generated) * self.costs.c_prefill_ms + n * expected * self.costs.c_decode_ms

    def decide(
        self,
        prompt_tokens: int,
        max_tokens: int,
        n: int,
        queued_ms: float,
        pool_fits: bool = True,
        row_wait_ms: Callable[[], float] | None = None,
        floor_tokens: int = 0,
    ) -> Decision:
        """400 when the request can never run, 429 when the waiting work is over its limit, else 200.

        `queued_ms` is the estimated GPU work waiting ahead of this request: work that cannot
        start now, as `AdmissionLedger.ahead_ms` counts it for the request's tenant (the scheduler
        passes 0 for a request that can join at the next pass, which is not waiting). Nothing
        ahead always admits, so a single request costlier than the limit is slow, not impossible.

        Retry-After is the projected time for the queue ahead to drain: until a row frees
        (`row_wait_ms()`, asked only on refusal), then the waiting work, priced at a full batch,
        drains at about one GPU millisecond per millisecond. Whole seconds, in [1, 60].
        A waiting-work figure that is not a finite number counts as a full queue (fail closed).
        """
        total = prompt_tokens + max_tokens
        too_long = context_error(prompt_tokens, max_tokens, self.context_limit)
        if too_long is not None:
            return Decision(400, code=CONTEXT_LENGTH_EXCEEDED, message=too_long)
        if self.max_tokens_limit and max_tokens > self.max_tokens_limit:
            return Decision(
                400,
                code="max_tokens_too_large",
                message=f"max_tokens {max_tokens} is over the limit of {self.max_tokens_limit}",
            )
        if n > self.max_rows:
            return Decision(
                400, code="n_too_large", message=f"n={n} samples is over this server's {self.max_rows} rows; lower n"
            )
        if not pool_fits:
            return Decision(
                400,
                code="too_large_for_kv_pool",
                message=f"{n} sample(s) of {total} tokens do not fit this server's KV cache; "
                f"lower n, max_tokens or the prompt length",
            )
        est = self.estimate_ms(prompt_tokens, max_tokens, n, floor_tokens=floor_tokens)
        if not math.isfinite(queued_ms):
            queued_ms = self.queue_limit_ms
        if queued_ms > 0 and queued_ms + est > self.queue_limit_ms:
            drain_ms = queued_ms + (row_wait_ms() if row_wait_ms is not None else 0.0)
            retry = _retry_after_s(drain_ms)
            return Decision(
                429,
                est_gpu_ms=est,
                code="overloaded",
                retry_after_s=float(retry),
                message=f"{queued_ms / 1000:.2f} s of GPU work is waiting ahead of this request (this key's "
                f"queue and the others' up to as much; limit {self.queue_limit_ms / 1000:.2f} s); "
                f"retry after {retry} s",
            )
        return Decision(200, est_gpu_ms=est)

    def problem(self) -> str | None:
        """Why an estimate admission reads is unusable, or None (the scheduler's integrity check)."""
        return self.costs.problem() or self.answers.problem()

    def observe_step(self, step_ms: float, prefill_tokens: int, decode_rows: int) -> None:
        self.costs.observe(step_ms, prefill_tokens, decode_rows)

    def observe_answer(self, completion_tokens: int) -> None:
        self.answers.add(completion_tokens)


def _retry_after_s(drain_ms: float) -> int:
    """Whole seconds in [1, RETRY_AFTER_MAX_S]; a projection that is not a number is the cap."""
    if not drain_ms < math.inf:  # infinite or NaN
        return RETRY_AFTER_MAX_S
    return min(max(1, math.ceil(drain_ms / 1000.0)), RETRY_AFTER_MAX_S)


class AdmissionLedger:
    """The waiting work admission bounds, per tenant, and the rows and blocks that requests
    admitted to start at the next pass have reserved (`docs/design.md#admission`).

    A waiting request is charged its estimate to its tenant until it joins or ends. Under fair
    sharing, the work that runs before a new request of tenant T starts is T's own queue plus, from
    every other tenant, at most as much as T has queued (each gets its share of the GPU meanwhile):
    `ahead_ms(T) = sum over tenants j of min(W_j, W_T)`. With one tenant that is its queue, as
    before; a tenant with nothing queued has nothing ahead of it (fair preemption starts its head
    request within `fair_preempt_steps + 1` passes), so another tenant's flood never refuses it.
    """

    __slots__ = ("_waiting", "_counts", "_reserved", "reserved_blocks")

    def __init__(self) -> None:
        self._waiting: dict[str, float] = {}  # tenant -> ms of its waiting requests' estimates
        self._counts: dict[str, int] = {}  # tenant -> waiting requests with a charge
        self._reserved: dict[Request, int] = {}  # admitted to start now, not joined yet -> blocks
        self.reserved_blocks = 0

    # -- waiting work ----------------------------------------------------------------------------

    def charge(self, req: Request, ms: float) -> None:
        """`req` waits: its `ms` count as its tenant's waiting work until it joins or ends."""
        t = req.tenant
        req.queued_est_ms = ms
        self._waiting[t] = self._waiting.get(t, 0.0) + ms
        self._counts[t] = self._counts.get(t, 0) + 1

    def uncharge(self, req: Request) -> None:
        if not req.queued_est_ms:
            return
        t, ms = req.tenant, req.queued_est_ms
        req.queued_est_ms = 0.0
        self._counts[t] -= 1
        if self._counts[t]:
            self._waiting[t] -= ms
        else:  # NOTE: no float residue once nothing of the tenant's waits
            del self._counts[t], self._waiting[t]

    @property
    def any_waiting(self) -> bool:
        return bool(self._counts)

    @property
    def total_ms(self) -> float:
        return sum(self._waiting.values())

    def ahead_ms(self, tenant: str) -> float:
        """Waiting work that runs before a new request of `tenant` would start (class docstring)."""
        mine = self._waiting.get(tenant, 0.0)
        if not mine:
            return 0.0
        return sum(min(w, mine) for w in self._waiting.values())

    def waiting_by_tenant(self) -> dict[str, tuple[float, int]]:
        """tenant -> (waiting ms, charged requests), for the integrity check."""
        return {t: (self._waiting[t], self._counts[t]) for t in self._counts}

    # -- reservations ----------------------------------------------------------------------------

    def reserve(self, req: Request, blocks: int) -> None:
        """`req` was admitted as able to start at the next pass: its row and `blocks` are held."""
        req.starts_now = True
        self._reserved[req] = blocks
        self.reserved_blocks += blocks

    def release(self, req: Request) -> None:
        """`req` joined or ended (or waits after all): its reservation ends."""
        if req.starts_now:
            req.starts_now = False
            self.reserved_blocks -= self._reserved.pop(req)

    @property
    def starting(self) -> list[Request]:
        return list(self._reserved)

    @property
    def reserved_rows(self) -> int:
        return len(self._reserved)
