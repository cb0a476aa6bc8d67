"""Step-time sequences that drive the step cost model (`gpu_proc/cost_model.py`) the way a long
uptime does, and the way no test of a few hundred steps can: ordinary traffic for hundreds of
thousands of steps, and every kind of garbage a clock and a batch can produce.

An observation is `(step_ms, StepShape)`, as `CostModel.observe` takes it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

from ringserve.gpu_proc.step_shape import StepShape

Observation = tuple[float, StepShape]


def issue_21(steps: int = 100_000, seed: int = 0) -> Iterator[Observation]:
    """Issue 21's reproduction: rows from {1, 1, 1, 2, 3}, 3 ms + 0.3 ms/row +- 0.05 ms. The
    recursive-least-squares fit of issue 21 ran to NaN after ~9,500 of these (it was driven for
    400,000; a hundred thousand is ten times past that, at the cost of a 4x4 solve per step)."""
    rng = random.Random(seed)
    for _ in range(steps):
        r = rng.choice((1, 1, 1, 2, 3))
        yield 3.0 + 0.3 * r + rng.gauss(0, 0.05), StepShape.decode_rows(r, 16)


def garbage(seed: int = 0, max_rows: int = 32) -> Iterator[Observation]:
    """A few thousand steps of each thing a long-running loop can feed the model: zero, negative,
    NaN, infinite, denormal and huge times; counts beyond any cap and empty steps; one row count
    forever; bursts between 1 and `max_rows` rows; prefill-only runs of 1 to 16k tokens; hardware
    that becomes 10x slower and then 100x faster."""
    rng = random.Random(seed)
    bad = (0.0, -1.0, float("nan"), float("inf"), -float("inf"), 5e-324, 1e-300, 1e300, 1.7e308)
    huge = (0, 1, 256, 1 << 40, -5)
    for _ in range(2000):
        yield rng.choice(bad), StepShape(rng.choice(huge), rng.choice(huge), rng.choice(huge), rng.choice(huge))
    for _ in range(5000):
        yield 40.0 + rng.gauss(0, 0.01), StepShape.decode_rows(max_rows, 100)  # never varies
    for k in range(10_000):
        rows = 1 if (k // 500) % 2 else max_rows  # bursts
        yield 25.0 + 0.5 * rows + (rng.random() < 0.01) * 1e6, StepShape.decode_rows(rows, 100)  # and GC pauses
    for _ in range(5000):
        p = rng.randint(1, 16_384)
        yield rng.uniform(1e-6, 1e4), StepShape.chunk(rng.randint(0, 8192), p)  # prefill only, any time
    for _ in range(5000):
        rows = rng.randint(1, max_rows)
        yield 10 * (25.0 + 0.5 * rows), StepShape.decode_rows(rows, 100)  # 10x slower
    for _ in range(5000):
        rows = rng.randint(1, max_rows)
        shape = StepShape.decode_rows(rows, 100) + (StepShape.chunk(0, 64) if rng.random() < 0.25 else StepShape())
        yield (25.0 + 0.5 * rows) / 100, shape  # 100x faster, some prefill


def long_uptime(seed: int = 0) -> Iterator[Observation]:
    """The issue's sequence, then the garbage, then the issue's sequence again."""
    yield from issue_21(seed=seed)
    yield from garbage(seed=seed)
    yield from issue_21(steps=20_000, seed=seed + 1)
