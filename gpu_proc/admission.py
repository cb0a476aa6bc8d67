"""Admission control: the cost model, the 400/429 decisions, and the cost model's online fit.

`est_gpu_ms = prompt_tokens * c_prefill + n * expected_output * c_decode`, where the expected
output is min(max_tokens, the recent average answer length). The constants start at 0.1 ms per
prompt token and 1.25 ms per output token (a 40 ms step shared by 32 rows) and follow measured step
times, so the "2 s of waiting GPU work" limit means 2 s on this hardware (`docs/design.md#admission`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from ringserve.rules import CONTEXT_LENGTH_EXCEEDED, context_error


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


class CostModel:
    """GPU milliseconds per prompt token and per output token, fitted online from step times.

    Decode: a step of r decoding rows takes `base + per_row * r` ms; every step reads all the
    weights once (base) and each row adds a little (`docs/design.md#admission`: 25 ms at 1 row,
    40 ms at 32). Work only queues when the batch is full, so an output token is priced at a full batch:
    `c_decode = (base + per_row * max_rows) / max_rows`. Pricing at one point of a fitted line,
    rather than averaging ms/row, keeps a quiet spell of 1-row steps (25 ms per token) from making
    the next burst look 20x dearer and drawing spurious 429s. The line is fitted by recursive least
    squares with forgetting on pure-decode steps, starting from the design's shape scaled to the
    configured c_decode; its covariance is capped at the prior's so constant row counts cannot wind
    it up, and each residual is clipped so one odd step (a GC pause, a first CUDA launch) moves it
    little.

    Prefill: steps with prompt tokens attribute what the decode line does not explain to them,
    followed by an exponential moving average (`alpha`). Both constants stay within [1/100, 100]
    times their start values.
    """

    __slots__ = (
        "c_prefill_ms",
        "c_decode_ms",
        "max_rows",
        "alpha",
        "forget",
        "_theta",
        "_p",
        "_p0_trace",
        "_bounds_p",
        "_bounds_d",
    )

    def __init__(
        self,
        c_prefill_ms: float = 0.1,
        c_decode_ms: float = 1.25,
        *,
        max_rows: int = 32,
        alpha: float = 0.05,
        forget: float = 0.99,
    ) -> None:
        if c_prefill_ms <= 0 or c_decode_ms <= 0:
            raise ValueError("cost constants must be > 0")
        if max_rows <= 0:
            raise ValueError(f"max_rows must be > 0, got {max_rows}")
        if not 0 < alpha <= 1 or not 0 < forget <= 1:
            raise ValueError("alpha and forget must be in (0, 1]")
        self.c_prefill_ms = c_prefill_ms
        self.c_decode_ms = c_decode_ms
        self.max_rows = max_rows
        self.alpha = alpha
        self.forget = forget
        full = c_decode_ms * max_rows
        # The design's shape (24.5 ms + 0.48 ms/row at 32 x 1.25 ms): 60 % of a full step is the base.
        self._theta = [0.6 * full, 0.4 * full / max_rows]
        self._p = [[self._theta[0] ** 2, 0.0], [0.0, self._theta[1] ** 2]]
        self._p0_trace = self._p[0][0] + self._p[1][1]
        self._bounds_p = (c_prefill_ms / 100, c_prefill_ms * 100)
        self._bounds_d = (c_decode_ms / 100, c_decode_ms * 100)

    def decode_step_ms(self, rows: int) -> float:
        """The fitted time of a pure decode step with `rows` rows."""
        return self._theta[0] + self._theta[1] * rows

    def observe(self, step_ms: float, prefill_tokens: int, decode_rows: int) -> None:
        """Fold one measured step into the constants."""
        if not math.isfinite(step_ms) or step_ms <= 0 or (prefill_tokens <= 0 and decode_rows <= 0):
            return
        if prefill_tokens > 0:
            rest = step_ms - (self.decode_step_ms(decode_rows) if decode_rows > 0 else 0.0)
            if rest > 0:  # else decode explains the whole step; nothing to learn about prefill
                sample = rest / prefill_tokens
                self.c_prefill_ms = _clamp(
                    self.c_prefill_ms + self.alpha * (sample - self.c_prefill_ms), self._bounds_p
                )
            return
        self._fit_decode(step_ms, decode_rows)
        full = self.decode_step_ms(self.max_rows)
        self.c_decode_ms = _clamp(full / self.max_rows, self._bounds_d)

    def _fit_decode(self, y: float, rows: int) -> None:
        """One recursive-least-squares step for y = base + per_row * rows."""
        (p00, p01), (p10, p11) = self._p
        px0, px1 = p00 + p01 * rows, p10 + p11 * rows  # P x, with x = (1, rows)
        denom = self.forget + px0 + px1 * rows
        k0, k1 = px0 / denom, px1 / denom
        pred = self.decode_step_ms(rows)
        err = min(max(y - pred, -0.5 * pred), pred)
        self._theta[0] += k0 * err
        self._theta[1] += k1 * err
        f = self.forget
        p = [[(p00 - k0 * px0) / f, (p01 - k0 * px1) / f], [(p10 - k1 * px0) / f, (p11 - k1 * px1) / f]]
        trace = p[0][0] + p[1][1]
        if trace > self._p0_trace:
            scale = self._p0_trace / trace
            p = [[v * scale for v in row] for row in p]
        self._p = p


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    return min(max(x, bounds[0]), bounds[1])


class AnswerLengths:
    """The mean completion length of the last `window` finished rows (`docs/design.md#admission`: ~300 to start)."""

    __slots__ = ("_window", "_sum", "_initial")

    def __init__(self, initial: float = 300.0, window: int = 256) -> None:
        if window <= 0:
            raise ValueError(f"window must be > 0, got {window}")
        self._window: deque[int] = deque(maxlen=window)
        self._sum = 0
        self._initial = initial

    def add(self, completion_tokens: int) -> None:
        if len(self._window) == self._window.maxlen:
            self._sum -= self._window[0]
        self._window.append(completion_tokens)
        self._sum += completion_tokens

    @property
    def mean(self) -> float:
        return self._sum / len(self._window) if self._window else self._initial


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
        self.answers = AnswerLengths(initial_answer_tokens)

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

    def estimate_ms(self, prompt_tokens: int, max_tokens: int, n: int = 1, generated: int = 0) -> float:
        """GPU ms still owed to a request that has `generated` tokens per row so far."""
        expected = max(min(max_tokens, self.answers.mean) - generated, 0.0)
        return (prompt_tokens + generated) * self.costs.c_prefill_ms + n * expected * self.costs.c_decode_ms

    def decide(
        self,
        prompt_tokens: int,
        max_tokens: int,
        n: int,
        queued_ms: float,
        pool_fits: bool = True,
        row_wait_ms: Callable[[], float] | None = None,
    ) -> Decision:
        """400 when the request can never run, 429 when the waiting work is over its limit, else 200.

        `queued_ms` is the estimated GPU work waiting: work that cannot start now (the scheduler
        passes 0 for a request that can join at the next pass, which is not waiting). Nothing waiting always
        admits, so a single request costlier than the limit is slow, not impossible.

        Retry-After is the projected time for the queue ahead to drain: until a row frees
        (`row_wait_ms()`, asked only on refusal), then the waiting work, priced at a full batch,
        drains at about one GPU millisecond per millisecond. Whole seconds, at least 1.
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
        est = self.estimate_ms(prompt_tokens, max_tokens, n)
        if queued_ms > 0 and queued_ms + est > self.queue_limit_ms:
            drain_ms = queued_ms + (row_wait_ms() if row_wait_ms is not None else 0.0)
            retry = max(1, math.ceil(drain_ms / 1000.0))
            return Decision(
                429,
                est_gpu_ms=est,
                code="overloaded",
                retry_after_s=float(retry),
                message=f"{queued_ms / 1000:.2f} s of GPU work is waiting for a row (limit "
                f"{self.queue_limit_ms / 1000:.2f} s); retry after {retry} s",
            )
        return Decision(200, est_gpu_ms=est)

    def observe_step(self, step_ms: float, prefill_tokens: int, decode_rows: int) -> None:
        self.costs.observe(step_ms, prefill_tokens, decode_rows)

    def observe_answer(self, completion_tokens: int) -> None:
        self.answers.add(completion_tokens)
