"""The cost model of a step, and the estimators admission reads (`docs/design.md#cost-model`).

A step's time is modelled from what it holds (`StepShape`):

    ms = base + per_token * tokens + per_logit * logits + per_read * reads

`tokens` are the tokens fed through the layers (decode rows, draft tokens and prefill chunks
alike), `logits` the positions whose logits are computed and sampled or scored (each decode row
and verified draft position, a chunk's last token when it samples, scored prompt tokens), and
`reads` the attention work: over every token of the step, the keys it attends to. `base` is what
every step pays (reading the weights once, launching the step). On a GPU a decode row costs ~10x
a prompt token (the configured 1.25 : 0.1 split); on a CPU both are compute-bound and cost about
the same; the fit finds which without being told.

The four coefficients are one weighted least-squares fit over every step, decode, prefill and
mixed alike, with three properties that make it hold for the server's whole uptime
(STYLE.md rule 13):

- **A prior that never fades.** The model starts from a prior fit (`Calibration`: synthetic steps
  of each kind timed on the device before READY, or the configured constants where there are
  none) whose samples count as `PRIOR_WEIGHT` observations each, forever. The online statistics
  fade (`forget` per step); where recent steps say nothing about a coefficient (no prefill for an
  hour), the prior holds it. The normal matrix is the prior's, positive definite by construction,
  plus a forgetting sum of outer products, so it stays positive definite and its solve never
  meets a zero pivot.
- **Relative errors, robustly weighted.** Each observation is weighted by 1 / estimate^2 (a 2 s
  prefill step and a 20 ms decode step count alike) and by a Huber weight on its relative error,
  against a scale that follows the errors themselves: a GC pause counts for little, while hardware
  that really became slower raises the scale and is followed in full. No observation is clipped,
  so the fit converges to any law it is shown.
- **Bounded and checked.** Each coefficient is solved within a box around the prior
  ([1/BOUND, BOUND] x; the logits and reads terms may reach 0), every derived price is clamped to
  [1/BOUND, BOUND] x its prior value, `problem()` states the invariants (the scheduler's integrity
  check runs it), and `observe` falls back to the prior, logging once, if a value is ever not
  finite after all. It never raises: it runs inside the GPU loop, where an exception ends the
  process. (An earlier recursive-least-squares form let its covariance turn indefinite in
  floating point and ran to NaN after ~10^4 steps: issue 21.)

Everything that prices work reads this one model: admission (`request_ms`), Retry-After
(`decode_step_ms`), the step's time budget (`step_ms`, `chunk_tokens_within`), fair queueing's
output-token weight (`output_token_weight`) and speculation's draft pricing (`decode_step_ms`).
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Iterable, Sequence

from ringserve.config import DEFAULTS
from ringserve.gpu_proc.least_squares import solve_box
from ringserve.gpu_proc.step_shape import StepShape, chunk_reads

log = logging.getLogger("ringserve.gpu")

N = 4  # coefficients: base, per_token, per_logit, per_read
NAMES = ("base_ms", "per_token_ms", "per_logit_ms", "per_read_ms")
PRIOR_WEIGHT = 2.0  # each prior sample starts as this many observations (fading like the steps) ...
PRIOR_FLOOR = 1e-3  # ... and counts as this many forever (see `_reset`)
BOUND = 100.0  # coefficients and prices stay within [1/BOUND, BOUND] x their prior values
HUBER = 3.0  # an observation's weight falls off past HUBER x the running scale of relative errors
SCALE_RATE = 0.02  # how fast that scale follows the errors (~50 steps)
SCALE_FLOOR, SCALE_CEIL = 0.02, 10.0
CONTEXT_RATE = 0.01  # how fast the mean context of a decode row follows the steps
AUDIT_WINDOW = 256  # steps of each kind whose measured / estimated ratio `StepAudit` keeps


Sample = tuple[StepShape, float]  # a step and its measured ms


class CostModel:
    """Step time from what a step holds, fitted online from every step (module docstring).

    `max_rows` and `prefill_scale` only scale the features (so the 4x4 solve is well conditioned)
    and say what a full batch is (an output token is priced at a full batch: work only queues
    when the batch is full, and a quiet spell of one-row steps must not make the next burst look
    20x dearer)."""

    __slots__ = (
        "max_rows",
        "forget",
        "resets",
        "_scale",
        "_prior",
        "_theta0",
        "_lo",
        "_hi",
        "_p_mat",
        "_p_vec",
        "_s_mat",
        "_s_vec",
        "_theta",
        "_err_scale",
        "_ctx",
        "_ctx0",
        "_price0",
    )

    def __init__(
        self,
        c_prefill_ms: float = DEFAULTS.c_prefill_ms,
        c_decode_ms: float = DEFAULTS.c_decode_ms,
        *,
        max_rows: int = DEFAULTS.max_rows,
        prefill_scale: int = DEFAULTS.prefill_budget,
        forget: float = 0.995,
        calibration: Sequence[Sample] = (),
        context0: float = 256.0,
    ) -> None:
        if not (0 < c_prefill_ms < math.inf and 0 < c_decode_ms < math.inf):
            raise ValueError("cost constants must be finite and > 0")
        if max_rows <= 0 or prefill_scale <= 0:
            raise ValueError(f"max_rows and prefill_scale must be > 0, got {max_rows}, {prefill_scale}")
        if not 0 < forget < 1:
            raise ValueError(f"forget must be in (0, 1), got {forget}")
        if not 1 <= context0 < math.inf:
            raise ValueError(f"context0 must be >= 1, got {context0}")
        self.max_rows = max_rows
        self.forget = forget
        self.resets = 0  # times the state was found unusable and the prior restored
        self._scale = (1.0, float(prefill_scale), float(max_rows), float(max_rows) * 1024.0)
        self._ctx0 = context0
        samples = [s for s in calibration if _usable(s)]
        if len(samples) >= N:
            self._p_mat, self._p_vec = _normal(samples, 1.0, self._scale)
            theta0 = solve_box(self._p_mat, self._p_vec, [1e-9, 1e-12, 0.0, 0.0], [math.inf] * N)
        else:
            theta0, samples = self._constants_prior(c_prefill_ms, c_decode_ms, max_rows, prefill_scale)
            self._p_mat, self._p_vec = _normal(samples, 1.0, self._scale)
        self._prior = samples
        full = max(_dot(theta0, self._x(StepShape.decode_rows(max_rows, int(context0)))), 1e-6)
        # NOTE: base and per_token keep a positive floor (every step and every token costs
        # something, so every price is > 0); per_logit and per_read may fit to 0.
        self._lo = [theta0[0] / BOUND, theta0[1] / BOUND, 0.0, 0.0]
        self._hi = [max(t, full) * BOUND for t in theta0]
        self._theta0 = [min(max(t, lo), hi) for t, lo, hi in zip(theta0, self._lo, self._hi)]
        self._price0 = (0.0, 0.0)
        self._reset()
        self._price0 = (self.c_prefill_ms, self.c_decode_ms)

    def _constants_prior(
        self, c_prefill: float, c_decode: float, max_rows: int, prefill_scale: int
    ) -> tuple[list[float], list[Sample]]:
        """The configured constants as a prior: the design's decode line (a full batch costs
        max_rows x c_decode, 60 % of it the base), prompt tokens at c_prefill each, keys read
        at no cost; its coefficients (scaled) and the steps it prices, for the normal matrix."""
        full = c_decode * max_rows
        base, per_row = 0.6 * full, 0.4 * full / max_rows
        # NOTE: a decode row is a token and a logits row, so a prompt token cannot cost more than
        # a decode row does; constants that say so are priced at the decode row.
        per_token = min(c_prefill, per_row)
        theta = [base, per_token * self._scale[1], (per_row - per_token) * self._scale[2], 0.0]
        shapes = (
            StepShape.decode_rows(1, 16),
            StepShape.decode_rows(max_rows, 16),
            StepShape.chunk(0, prefill_scale),
            StepShape.chunk(0, 16),
        )
        return theta, [(shape, _dot(theta, self._x(shape))) for shape in shapes]

    def _reset(self) -> None:
        """The prior alone: its samples as PRIOR_WEIGHT observations each, its coefficients, a
        neutral error scale. The samples then fade like any step, down to PRIOR_FLOOR each,
        which never fades: it keeps the normal matrix positive definite and holds a coefficient
        that recent steps say nothing about (no prefill for an hour) where the prior put it,
        without pulling on one they do show (a prior 10x off, as configured GPU constants are on
        a CPU, would otherwise bias the fit for good)."""
        k = PRIOR_WEIGHT + PRIOR_FLOOR
        self._s_mat = [[k * p for p in row] for row in self._p_mat]
        self._s_vec = [k * p for p in self._p_vec]
        self._theta = list(self._theta0)
        self._err_scale = 0.1
        self._ctx = self._ctx0

    def _x(self, shape: StepShape) -> list[float]:
        s = self._scale
        return [1.0, (shape.decode + shape.prefill) / s[1], (shape.decode + shape.logits) / s[2], shape.reads / s[3]]

    # -- prices ----------------------------------------------------------------------------------

    def coefficients(self) -> dict[str, float]:
        """The fitted coefficients in ms per unit (per token, per logits row, per key read)."""
        return {name: t / s for name, t, s in zip(NAMES, self._theta, self._scale)}

    def step_ms(self, shape: StepShape) -> float:
        """The estimated time of a step holding `shape` (finite and > 0)."""
        return _dot(self._theta, self._x(shape))

    def chunk_ms(self, start: int, tokens: int) -> float:
        """What adding a prefill chunk of `tokens` after `start` cached tokens adds to a step
        (without its logits row)."""
        t = self._theta
        s = self._scale
        return t[1] * tokens / s[1] + t[3] * chunk_reads(start, tokens) / s[3]

    def chunk_tokens_within(self, ms: float, start: int, cap: int) -> int:
        """The most tokens, at most `cap`, that a chunk after `start` cached tokens may have for
        `chunk_ms` to stay within `ms` (0 when none fit): the root of a quadratic in the tokens."""
        if cap <= 0 or not ms > 0:
            return 0
        a = self._theta[3] / self._scale[3] / 2.0  # reads: n * start + n (n + 1) / 2
        b = self._theta[1] / self._scale[1] + self._theta[3] / self._scale[3] * (start + 0.5)
        n = ms / b if a <= 0 else (-b + math.sqrt(b * b + 4.0 * a * ms)) / (2.0 * a)
        n = int(min(n, cap)) if math.isfinite(n) else 0
        while n > 0 and self.chunk_ms(start, n) > ms:  # NOTE: float rounding at the root
            n -= 1
        return max(n, 0)

    def decode_step_ms(self, rows: int) -> float:
        """The fitted time of a decode-only step of `rows` rows at the recent mean context."""
        return self.step_ms(StepShape.decode_rows(rows, int(self._ctx)))

    @property
    def c_decode_ms(self) -> float:
        """ms per output token at a full batch and the recent mean context."""
        return _clamp(self.decode_step_ms(self.max_rows) / self.max_rows, self._price_bounds(1))

    @property
    def c_prefill_ms(self) -> float:
        """ms per prompt token of a prompt of the recent mean context (its reads: half of it)."""
        return _clamp(self.chunk_ms(0, max(int(self._ctx), 1)) / max(int(self._ctx), 1), self._price_bounds(0))

    def output_token_weight(self) -> float:
        """What an output token costs against a prompt token (fair queueing's weight), >= 1."""
        return min(max(self.c_decode_ms / self.c_prefill_ms, 1.0), BOUND * BOUND)

    def request_ms(self, prompt_tokens: int, output_tokens: float, n: int = 1, generated: int = 0) -> float:
        """GPU ms still owed to a request: its prompt (plus what it generated, if it must be
        recomputed) once, and `output_tokens` more per sample at a full batch, each reading the
        context so far."""
        t, s = self._theta, self._scale
        p = prompt_tokens + generated
        prefill = t[1] * p / s[1] + t[3] * chunk_reads(0, p) / s[3]
        per_token = self.decode_step_ms(self.max_rows) / self.max_rows - t[3] * (int(self._ctx) + 1) / s[3]
        out = max(output_tokens, 0.0)
        decode = out * (per_token + t[3] * (p + out / 2.0 + 1.0) / s[3])
        return prefill + n * decode

    @property
    def prior_prices(self) -> tuple[float, float]:
        """(c_prefill_ms, c_decode_ms) of the prior: every price stays within [1/BOUND, BOUND] x them."""
        return self._price0

    def _price_bounds(self, which: int) -> tuple[float, float]:
        p0 = self._price0[which]
        return (p0 / BOUND, p0 * BOUND) if p0 > 0 else (0.0, math.inf)

    # -- fitting ---------------------------------------------------------------------------------

    def observe(self, step_ms: float, shape: StepShape) -> float:
        """Fold one measured step into the fit; returns what the model expected of it. Never
        raises (see the module docstring)."""
        try:
            expected = self.step_ms(shape)
            if not (0.0 < step_ms < math.inf) or shape.empty or not _sane(shape):
                return expected
            if not 1e-12 < step_ms / expected < 1e12:  # no clock reads this: a denormal, a wrapped counter
                return expected
            self._fit(step_ms, shape, expected)
        except (ArithmeticError, ValueError) as exc:  # NOTE: unreachable by construction; the fallback is the guarantee
            self._fall_back(f"{type(exc).__name__}: {exc}")
            return self.step_ms(shape)
        # NOTE: a cheap finiteness test per step (a NaN or an infinity anywhere makes the sum
        # non-finite); `problem()` checks everything in full.
        if not math.isfinite(sum(self._theta) + sum(self._s_vec) + self._err_scale + self._ctx):
            self._fall_back(self.problem() or "a fitted value is not finite")
        return expected

    def _fit(self, y: float, shape: StepShape, expected: float) -> None:
        x = self._x(shape)
        # NOTE: the error is a log ratio (a step twice as long counts as much as one half as long),
        # weighted down past HUBER x its running scale; the observation's own scale is the larger of
        # its time and its estimate, so neither a stalled step nor a clock glitch dominates the sums.
        u = abs(math.log(y / expected))
        c = HUBER * self._err_scale
        h = 1.0 if u <= c else c / u
        self._err_scale = min(
            max(self._err_scale + SCALE_RATE * (min(u, SCALE_CEIL) - self._err_scale), SCALE_FLOOR), SCALE_CEIL
        )
        scale = max(y, expected)
        w = h / (scale * scale)
        # NOTE: the sums hold the online steps (fading by `forget`) plus PRIOR_FLOOR x the prior,
        # which the (1 - f) share re-adds each step, so that part never fades.
        f = self.forget
        g = (1.0 - f) * PRIOR_FLOOR
        m, v, pm, pv = self._s_mat, self._s_vec, self._p_mat, self._p_vec
        for i in range(N):
            wx = w * x[i]
            row, prow = m[i], pm[i]
            for j in range(N):
                row[j] = f * row[j] + wx * x[j] + g * prow[j]
            v[i] = f * v[i] + wx * y + g * pv[i]
        self._theta = solve_box(m, v, self._lo, self._hi)
        if shape.decode and not shape.prefill:
            ctx = shape.reads / shape.decode - 1.0
            self._ctx = min(max(self._ctx + CONTEXT_RATE * (ctx - self._ctx), 1.0), 1e9)

    def problem(self) -> str | None:
        """Why the model cannot be used (not finite, out of bounds), or None."""
        for name, t, lo, hi in zip(NAMES, self._theta, self._lo, self._hi):
            if not (math.isfinite(t) and lo <= t <= hi):
                return f"{name} = {t!r} is outside [{lo:g}, {hi:g}] (scaled)"
        for i in range(N):
            if not (math.isfinite(self._s_vec[i]) and self._s_mat[i][i] >= 0 and math.isfinite(self._s_mat[i][i])):
                return f"the fit's sums are unusable (row {i}: {self._s_mat[i][i]!r}, {self._s_vec[i]!r})"
        if not (SCALE_FLOOR <= self._err_scale <= SCALE_CEIL):
            return f"error scale {self._err_scale!r} is outside [{SCALE_FLOOR}, {SCALE_CEIL}]"
        if not 1.0 <= self._ctx <= 1e9:
            return f"mean decode context {self._ctx!r} is outside [1, 1e9]"
        for name, price in (("c_prefill_ms", self.c_prefill_ms), ("c_decode_ms", self.c_decode_ms)):
            if not (math.isfinite(price) and price > 0):
                return f"{name} = {price!r} is not a positive number"
        return None

    def _fall_back(self, why: str) -> None:
        if not self.resets:
            log.warning("cost model reset to its prior: %s", why)
        self.resets += 1
        self._reset()


def _usable(sample: Sample) -> bool:
    shape, ms = sample
    return 0.0 < ms < math.inf and not shape.empty and _sane(shape)


def _sane(shape: StepShape) -> bool:
    """Counts a step can have (a corrupt one would otherwise dominate the sums)."""
    return (
        0 <= shape.decode < 1 << 24
        and 0 <= shape.prefill < 1 << 24
        and 0 <= shape.logits < 1 << 24
        and 0 <= shape.reads < 1 << 44
    )


def _normal(samples: Iterable[Sample], weight: float, scale) -> tuple[list[list[float]], list[float]]:
    """The prior's normal equations: sum of weight / ms^2 * x x^T, and of weight / ms^2 * x ms."""
    m = [[0.0] * N for _ in range(N)]
    v = [0.0] * N
    for shape, ms in samples:
        x = [
            1.0,
            (shape.decode + shape.prefill) / scale[1],
            (shape.decode + shape.logits) / scale[2],
            shape.reads / scale[3],
        ]
        w = weight / (ms * ms)
        for i in range(N):
            for j in range(N):
                m[i][j] += w * x[i] * x[j]
            v[i] += w * x[i] * ms
    # NOTE: a feature no prior sample has (reads, say) still gets a diagonal, so the matrix is
    # positive definite: the coefficient is then held near 0 until steps show it.
    for i in range(N):
        m[i][i] += 1e-9 * (1.0 + max(m[k][k] for k in range(N)))
    return m, v


def _dot(a: Sequence[float], b: Sequence[float]) -> float:
    return sum(p * q for p, q in zip(a, b))


def _clamp(x: float, bounds: tuple[float, float]) -> float:
    """`x` within `bounds`; NaN becomes the lower bound (min and max let NaN through)."""
    return min(max(x, bounds[0]), bounds[1]) if x == x else bounds[0]


class StepAudit:
    """Measured / estimated step time of the last `AUDIT_WINDOW` steps of each kind (decode,
    prefill, mixed): what `ringserve bench cost-model`, the soak and /metrics read."""

    KINDS = ("decode", "prefill", "mixed")  # NOTE: shm/stats_schema.STEP_KINDS names their stats

    __slots__ = ("_ratios", "steps")

    def __init__(self) -> None:
        self._ratios: dict[str, deque[float]] = {k: deque(maxlen=AUDIT_WINDOW) for k in self.KINDS}
        self.steps = dict.fromkeys(self.KINDS, 0)

    def add(self, kind: str, measured_ms: float, estimated_ms: float) -> None:
        if estimated_ms > 0 and 0 < measured_ms < math.inf:
            self._ratios[kind].append(measured_ms / estimated_ms)
            self.steps[kind] += 1

    def median(self, kind: str) -> float:
        """The median ratio of the kind's window (0.0 before its first step)."""
        r = sorted(self._ratios[kind])
        if not r:
            return 0.0
        mid = len(r) // 2
        return r[mid] if len(r) % 2 else (r[mid - 1] + r[mid]) / 2
