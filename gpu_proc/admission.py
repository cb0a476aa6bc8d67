"""Admission control: the price of a request and the 400/429 decisions.

`est_gpu_ms` is what the step cost model (`cost_model.py`, calibrated on the device before READY
and refitted from every step) says the request's prompt and its `n x expected output` tokens cost
here, where the expected output is min(max_tokens, the recent average answer length), and at least
what the request is sure to generate (`floor_tokens`: all of max_tokens with EOS ignored and no
stop ids). So the "2 s of waiting GPU work" limit means 2 s on this hardware
(`docs/design.md#admission`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ringserve.config import DEFAULTS
from ringserve.gpu_proc.cost_model import CostModel, Sample
from ringserve.gpu_proc.step_shape import StepShape
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
        context_limit: int = DEFAULTS.context_limit,
        max_tokens_limit: int = DEFAULTS.max_tokens_limit,
        max_rows: int = DEFAULTS.max_rows,
        queue_limit_s: float = DEFAULTS.queue_limit_s,
        c_prefill_ms: float = DEFAULTS.c_prefill_ms,
        c_decode_ms: float = DEFAULTS.c_decode_ms,
        initial_answer_tokens: float = 300.0,
        prefill_budget: int = DEFAULTS.prefill_budget,
        calibration: Sequence[Sample] = (),
    ) -> None:
        if queue_limit_s <= 0:
            raise ValueError(f"queue_limit_s must be > 0, got {queue_limit_s}")
        self.context_limit = context_limit
        self.max_tokens_limit = max_tokens_limit
        self.max_rows = max_rows
        self.queue_limit_ms = queue_limit_s * 1000.0
        self.costs = CostModel(
            c_prefill_ms, c_decode_ms, max_rows=max_rows, prefill_scale=prefill_budget, calibration=calibration
        )
        self.answers = AnswerLengths(initial_answer_tokens, cap=context_limit)

    @classmethod
    def from_config(cls, config, calibration: Sequence[Sample] = ()) -> AdmissionController:
        """Build from a `ringserve.config.Config` (duck-typed: any object with its field names) and
        the start-up calibration's samples (`calibration.py`; none: the configured constants)."""
        return cls(
            context_limit=config.context_limit,
            max_tokens_limit=config.max_tokens_limit,
            max_rows=config.max_rows,
            queue_limit_s=config.queue_limit_s,
            c_prefill_ms=config.c_prefill_ms,
            c_decode_ms=config.c_decode_ms,
            prefill_budget=config.prefill_budget,
            calibration=calibration,
        )

    def estimate_ms(
        self, prompt_tokens: int, max_tokens: int, n: int = 1, generated: int = 0, floor_tokens: int = 0
    ) -> float:
        """GPU ms still owed to a request that has `generated` tokens per row so far and will
        generate at least `floor_tokens` per row (so a flood of short answers cannot make a request
        that must run to max_tokens look cheap)."""
        expected = max(min(max_tokens, max(self.answers.mean, floor_tokens)) - generated, 0.0)
        return self.costs.request_ms(prompt_tokens, expected, n, generated)

    def decide(
        self,
        prompt_tokens: int,
        max_tokens: int,
        n: int,
        queued_ms: float,
        pool_fits: bool = True,
        row_wait_ms: Callable[[], float] | None = None,
        floor_tokens: int = 0,
        extra_ms: float = 0.0,
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
        `extra_ms` is work the request brings beyond its tokens (copying its LoRA adapter into a
        slot), priced with it.
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
        est = self.estimate_ms(prompt_tokens, max_tokens, n, floor_tokens=floor_tokens) + extra_ms
        if not math.isfinite(queued_ms):
            queued_ms = self.queue_limit_ms
        if queued_ms > 0 and queued_ms + est > self.queue_limit_ms:
            drain_ms = queued_ms + (row_wait_ms() if row_wait_ms is not None else 0.0)
            retry = retry_after_s(drain_ms)
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

    def observe_step(self, step_ms: float, shape: StepShape) -> float:
        """Fold one measured step into the cost model; what it expected of the step."""
        return self.costs.observe(step_ms, shape)

    def observe_answer(self, completion_tokens: int) -> None:
        self.answers.add(completion_tokens)


def retry_after_s(drain_ms: float) -> int:
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

    def ahead_ms(self, tenant: str, prefilling: Mapping[str, float] | None = None) -> float:
        """Work that runs before a new request of `tenant` would start (class docstring): each
        tenant's waiting work plus `prefilling`, the prefill its joined requests still owe
        (their chunks come first in the steps to come, so a request joining behind them waits
        for them as for a queue)."""
        work = self.work_by_tenant(prefilling)
        mine = work.get(tenant, 0.0)
        if not mine:
            return 0.0
        return sum(min(w, mine) for w in work.values())

    def work_by_tenant(self, prefilling: Mapping[str, float] | None = None) -> dict[str, float]:
        """tenant -> its waiting work plus `prefilling` (what `ahead_ms` weighs)."""
        if not prefilling:
            return self._waiting
        work = dict(self._waiting)
        for t, ms in prefilling.items():
            work[t] = work.get(t, 0.0) + ms
        return work

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


class AnswerLengths:
    """The mean completion length of the last `window` finished rows (`docs/design.md#admission`:
    ~300 to start). Integer sums of lengths clamped to [1, `cap`]: exact and finite."""

    __slots__ = ("_window", "_sum", "_initial", "_cap")

    def __init__(self, initial: float = 300.0, window: int = 256, cap: int = 1 << 20) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        if not 1 <= initial < math.inf or cap < 1:
            raise ValueError(f"the initial answer length ({initial}) and the cap ({cap}) must be finite and >= 1")
        self._window: deque[int] = deque(maxlen=window)
        self._sum = 0
        self._initial = initial
        self._cap = cap

    def add(self, completion_tokens: int) -> None:
        tokens = min(max(int(completion_tokens), 1), self._cap)
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0]
        self._window.append(tokens)
        self._sum += tokens

    @property
    def mean(self) -> float:
        return self._sum / len(self._window) if self._window else self._initial

    def problem(self) -> str | None:
        if self._sum != sum(self._window):
            return f"answer-length sum {self._sum} drifted from its window ({sum(self._window)})"
        return None
