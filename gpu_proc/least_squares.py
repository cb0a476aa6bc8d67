"""Least squares for the step cost model (`cost_model.py`): a small symmetric positive
semi-definite system solved by Cholesky, with each unknown kept in a box. Pure Python: the
systems are 4 x 4 and solved once a step."""

from __future__ import annotations

import math
from collections.abc import Sequence

RIDGE = 1e-9  # relative ridge of every solve (see `solve_box`)


def solve_box(a: list[list[float]], b: list[float], lo: Sequence[float], hi: Sequence[float]) -> list[float]:
    """Least squares `a theta = b` (a symmetric positive semi-definite) with each coefficient in
    [lo, hi]: solve, pin the coordinates that leave their box to the bound, solve for the rest;
    at most n rounds for n unknowns. Raises ArithmeticError only if `a` is not positive
    semi-definite."""
    # NOTE: a ridge of RIDGE x the largest diagonal keeps every pivot far above rounding error
    # however large the online sums grow beside the prior's floor (decode-only steps leave a
    # direction with no information at all); its pull on a coefficient is ~RIDGE relative.
    n = len(b)
    ridge = RIDGE * max(a[i][i] for i in range(n))
    a = [[v + ridge if i == j else v for j, v in enumerate(row)] for i, row in enumerate(a)]
    theta = cholesky_solve(a, b)
    fixed: dict[int, float] = {}
    for _ in range(n):
        out = {
            i: (lo[i] if theta[i] < lo[i] else hi[i])
            for i in range(n)
            if i not in fixed and not lo[i] <= theta[i] <= hi[i]
        }
        if not out:
            return theta
        fixed.update(out)
        free = [i for i in range(n) if i not in fixed]
        sol = cholesky_solve(
            [[a[i][j] for j in free] for i in free], [b[i] - sum(a[i][j] * fixed[j] for j in fixed) for i in free]
        )
        theta = [fixed[i] if i in fixed else 0.0 for i in range(n)]
        for k, i in enumerate(free):
            theta[i] = sol[k]
    return [min(max(t, lo_i), hi_i) for t, lo_i, hi_i in zip(theta, lo, hi)]


def cholesky_solve(a: list[list[float]], b: list[float]) -> list[float]:
    """`x` with `a x = b` for a symmetric positive definite `a` (ArithmeticError if it is not)."""
    n = len(b)
    low = [[0.0] * n for _ in range(n)]
    for i in range(n):
        for j in range(i + 1):
            s = a[i][j] - sum(low[i][k] * low[j][k] for k in range(j))
            if i == j:
                if not s > 0:
                    raise ArithmeticError(f"the normal matrix is not positive definite (pivot {s!r})")
                low[i][i] = math.sqrt(s)
            else:
                low[i][j] = s / low[j][j]
    y = [0.0] * n
    for i in range(n):
        y[i] = (b[i] - sum(low[i][k] * y[k] for k in range(i))) / low[i][i]
    x = [0.0] * n
    for i in reversed(range(n)):
        x[i] = (y[i] - sum(low[k][i] * x[k] for k in range(i + 1, n))) / low[i][i]
    return x
