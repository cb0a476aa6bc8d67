"""The online estimators admission reads: GPU ms per prompt and per output token, and the recent
answer length (`docs/design.md#admission`).

Admission holds for the server's whole uptime only if these stay meaningful under any sequence of
observations, so each is finite and bounded by construction, not by luck:

- every input is checked (finite, positive) and clipped to a band around the current estimate, so
  no single step (a GC pause, a first CUDA launch, a clock jump) moves an estimate far;
- every estimate is a convex combination of clipped inputs or a closed-form solve whose denominator
  is bounded away from zero, then clamped to [1/100, 100] times its configured value;
- `check()` states those invariants (the scheduler's integrity check runs it), and `observe` falls
  back to the configured constants, logging once, if an estimate is ever not finite after all. It
  never raises: it runs inside the GPU loop, where an exception ends the process.
"""

from __future__ import annotations

import logging
import math
from collections import deque

log = logging.getLogger("ringserve.gpu")

CLIP = 2.0  # one observation counts as at most CLIP x, at least 1/CLIP x, the current estimate
RIDGE_ROWS2 = 2.0  # prior weight on the slope, in observations x rows^2 of spread (see `_fit`)
PRIOR_WEIGHT = 1.0  # the configured constants count as this many observations at the start
BOUND = 100.0  # estimates stay within [1/BOUND, BOUND] x their configured values


class CostModel:
    """GPU milliseconds per prompt token and per output token, fitted online from step times.

    Decode: a step of r decoding rows takes `base + per_row * r` ms; every step reads all the
    weights once (base) and each row adds a little (`docs/design.md#admission`: 25 ms at 1 row,
    40 ms at 32). Work only queues when the batch is full, so an output token is priced at a full
    batch: `c_decode = (base + per_row * max_rows) / max_rows`. Pricing at one point of a fitted
    line, rather than averaging ms/row, keeps a quiet spell of 1-row steps (25 ms per token) from
    making the next burst look 20x dearer and drawing spurious 429s.

    The line is a weighted least-squares fit with exponential forgetting (`forget` per step),
    kept as sufficient statistics: the weighted means of rows and ms and their centred co-moments,
    updated in Welford's form (the row variance only ever adds a square, so it cannot turn
    negative). The slope is `(C_xy + ridge * slope0) / (C_xx + ridge)`: the denominator is at
    least `ridge`, and where the rows never vary it is the prior's slope (the design's shape,
    40 % of a full step spread over the rows) with the intercept through the measured mean, which
    is what steps at one row count can tell. (An earlier recursive-least-squares form let its
    covariance turn indefinite in floating point and ran to NaN after ~10^4 steps: issue 21.)

    Prefill: steps with prompt tokens attribute what the decode line does not explain to them,
    followed by an exponential moving average (`alpha`) of clipped samples.
    """

    __slots__ = (
        "max_rows",
        "alpha",
        "forget",
        "c_prefill_ms",
        "c_decode_ms",
        "_c_prefill0",
        "_c_decode0",
        "_slope0",
        "_w",
        "_mx",
        "_my",
        "_cxx",
        "_cxy",
        "_base",
        "_per_row",
        "_bounds_p",
        "_bounds_d",
        "_bounds_base",
        "_bounds_per_row",
        "resets",
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
        if not (0 < c_prefill_ms < math.inf and 0 < c_decode_ms < math.inf):
            raise ValueError("cost constants must be finite and > 0")
        if max_rows <= 0:
            raise ValueError(f"max_rows must be > 0, got {max_rows}")
        if not 0 < alpha <= 1 or not 0 < forget < 1:
            raise ValueError("alpha must be in (0, 1] and forget in (0, 1)")
        self.max_rows = max_rows
        self.alpha = alpha
        self.forget = forget
        self._c_prefill0 = c_prefill_ms
        self._c_decode0 = c_decode_ms
        full = c_decode_ms * max_rows
        self._slope0 = 0.4 * full / max_rows  # the design's shape: 24.5 ms + 0.48 ms/row at 32 x 1.25 ms
        self._bounds_p = (c_prefill_ms / BOUND, c_prefill_ms * BOUND)
        self._bounds_d = (c_decode_ms / BOUND, c_decode_ms * BOUND)
        self._bounds_base = (full / BOUND**2, full * BOUND)
        self._bounds_per_row = (0.0, full * BOUND / max_rows)
        self.resets = 0  # times an estimate was found unusable and the configured constants restored
        self._reset()

    def _reset(self) -> None:
        """The configured constants, as `PRIOR_WEIGHT` observations of a full batch."""
        self.c_prefill_ms = self._c_prefill0
        self.c_decode_ms = self._c_decode0
        full = self._c_decode0 * self.max_rows
        self._w = PRIOR_WEIGHT
        self._mx, self._my = float(self.max_rows), full
        self._cxx = self._cxy = 0.0
        self._per_row = self._slope0
        self._base = full - self._slope0 * self.max_rows

    def decode_step_ms(self, rows: int) -> float:
        """The fitted time of a pure decode step with `rows` rows (finite and > 0)."""
        return self._base + self._per_row * rows

    def step_ms(self, prefill_tokens: int, decode_rows: int) -> float:
        """The model's estimate of a step of `prefill_tokens` prompt tokens and `decode_rows` rows."""
        return (self.decode_step_ms(decode_rows) if decode_rows > 0 else 0.0) + prefill_tokens * self.c_prefill_ms

    def observe(self, step_ms: float, prefill_tokens: int, decode_rows: int) -> None:
        """Fold one measured step into the constants. Never raises (see the module docstring)."""
        if not (0.0 < step_ms < math.inf) or prefill_tokens < 0 or decode_rows < 0:
            return
        try:
            if prefill_tokens > 0:
                self._observe_prefill(step_ms, prefill_tokens, decode_rows)
            elif decode_rows > 0:
                self._fit(step_ms, min(decode_rows, self.max_rows))
        except ArithmeticError as exc:  # NOTE: unreachable by construction; the fallback is the guarantee
            self._fall_back(f"{type(exc).__name__}: {exc}")
            return
        # NOTE: a cheap finiteness test per step (a NaN or an infinity anywhere makes the sum
        # non-finite); the clamps keep every estimate in bounds, which `problem()` checks in full.
        if not math.isfinite(self._my + self._cxy + self._cxx + self.c_prefill_ms + self.c_decode_ms):
            self._fall_back(self.problem() or "a fitted sum is not finite")

    def _observe_prefill(self, step_ms: float, prefill_tokens: int, decode_rows: int) -> None:
        rest = step_ms - (self.decode_step_ms(min(decode_rows, self.max_rows)) if decode_rows > 0 else 0.0)
        if rest <= 0:  # decode explains the whole step; nothing to learn about prefill
            return
        c = self.c_prefill_ms
        sample = min(max(rest / prefill_tokens, c / CLIP), c * CLIP)
        self.c_prefill_ms = _clamp(c + self.alpha * (sample - c), self._bounds_p)

    def _fit(self, y: float, rows: int) -> None:
        """One step of the forgetting least-squares fit of `ms = base + per_row * rows`."""
        pred = self.decode_step_ms(rows)
        y = min(max(y, pred / CLIP), pred * CLIP)
        f = self.forget
        self._w = w = f * self._w + 1.0  # >= 1, and below 1 / (1 - f)
        dx, dy = rows - self._mx, y - self._my
        self._mx += dx / w
        self._my += dy / w
        self._cxx = f * self._cxx + dx * (rows - self._mx)  # adds dx^2 (1 - 1/w) >= 0
        self._cxy = f * self._cxy + dx * (y - self._my)
        slope = (self._cxy + RIDGE_ROWS2 * self._slope0) / (self._cxx + RIDGE_ROWS2)
        self._per_row = _clamp(slope, self._bounds_per_row)
        self._base = _clamp(self._my - self._per_row * self._mx, self._bounds_base)
        self.c_decode_ms = _clamp(self.decode_step_ms(self.max_rows) / self.max_rows, self._bounds_d)

    def problem(self) -> str | None:
        """Why the estimates cannot be used (not finite, not positive, out of bounds), or None."""
        values = {
            "c_prefill_ms": (self.c_prefill_ms, self._bounds_p),
            "c_decode_ms": (self.c_decode_ms, self._bounds_d),
            "base_ms": (self._base, self._bounds_base),
            "per_row_ms": (self._per_row, self._bounds_per_row),
            "mean_rows": (self._mx, (1.0, float(self.max_rows))),
            "row_variance": (self._cxx, (0.0, math.inf)),
            "weight": (self._w, (min(PRIOR_WEIGHT, 1.0), max(PRIOR_WEIGHT, 1.0 / (1.0 - self.forget)))),
        }
        for name, (value, (lo, hi)) in values.items():
            if not (math.isfinite(value) and lo <= value <= hi):
                return f"{name} = {value!r} is outside [{lo:g}, {hi:g}]"
        if not (math.isfinite(self._my) and math.isfinite(self._cxy) and self._my > 0):
            return f"the fit's sums are unusable (mean ms {self._my!r}, co-moment {self._cxy!r})"
        return None

    def _fall_back(self, why: str) -> None:
        if not self.resets:
            log.warning("admission cost model reset to its configured constants: %s", why)
        self.resets += 1
        self._reset()


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    """`x` within `bounds`; NaN becomes the lower bound (min and max let NaN through)."""
    return min(max(x, bounds[0]), bounds[1]) if x == x else bounds[0]


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
