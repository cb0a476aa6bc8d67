"""The admission cost model and answer-length estimate: they fit measured steps, and they stay
finite, positive and bounded under any sequence of observations (`gpu_proc/cost_model.py`)."""

import logging
import math
import random

import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from ringserve.gpu_proc.cost_model import BOUND, AnswerLengths, CostModel
from ringserve.gpu_proc.scheduler import SchedulerIntegrityError
from tests.helpers import cost_sequences
from tests.helpers.scheduler_fakes import make_harness, make_request


def test_cost_model_prices_decode_at_a_full_batch():
    """Steps of varied row counts on hardware with a 10 ms + 0.5 ms/row line: an output token is
    priced at the full batch, (10 + 0.5 * 32) / 32 = 0.8125 ms."""
    cm = CostModel(0.1, 1.25, max_rows=32)
    rng = random.Random(0)
    for _ in range(400):
        rows = rng.randint(1, 32)
        cm.observe(10.0 + 0.5 * rows, 0, rows)
    assert abs(cm.c_decode_ms - 0.8125) < 0.01
    assert abs(cm.decode_step_ms(1) - 10.5) < 0.2


def test_cost_model_with_constant_rows_follows_the_measured_step():
    """Always 32 rows at 64 ms: c_decode converges to 2 ms and the fit does not wind up."""
    cm = CostModel(0.1, 1.25, max_rows=32)
    for _ in range(2000):
        cm.observe(64.0, 0, 32)
    assert abs(cm.c_decode_ms - 2.0) < 0.01


def test_quiet_spell_of_one_row_steps_does_not_inflate_the_price():
    """25 ms steps with one row (the design's light load, `docs/design.md#admission`) leave c_decode near 1.25 ms, not 25."""
    cm = CostModel(0.1, 1.25, max_rows=32)
    for _ in range(500):
        cm.observe(25.0, 0, 1)
    assert 1.0 < cm.c_decode_ms < 1.6


def test_cost_model_learns_prefill_from_mixed_steps():
    """Mixed steps: what the decode line leaves unexplained is charged to the prompt tokens."""
    cm = CostModel(0.1, 1.25, max_rows=32, alpha=0.5)
    for _ in range(40):
        cm.observe(cm.decode_step_ms(32) + 256 * 0.2, 256, 32)
    assert abs(cm.c_prefill_ms - 0.2) < 1e-3
    for _ in range(40):
        cm.observe(512 * 0.3, 512, 0)  # prefill-only steps
    assert abs(cm.c_prefill_ms - 0.3) < 1e-3


def test_cost_model_ignores_garbage_and_limits_outliers():
    """Non-finite or empty steps change nothing; one huge step moves c_decode only a little."""
    cm = CostModel(0.1, 1.25, max_rows=32)
    cm.observe(float("nan"), 0, 4)
    cm.observe(10.0, 0, 0)
    assert (cm.c_prefill_ms, cm.c_decode_ms) == (0.1, 1.25)
    for _ in range(200):
        cm.observe(40.0, 0, 32)
    cm.observe(1e9, 0, 32)
    assert cm.c_decode_ms < 1.25 * 2


def test_answer_length_window():
    """The mean is over the last `window` answers."""
    al = AnswerLengths(initial=300, window=2)
    assert al.mean == 300
    al.add(10)
    al.add(20)
    al.add(40)
    assert al.mean == 30


def test_issue_21_reproduction_stays_finite_and_fits_the_steps():
    """400,000 steps of 3 ms + 0.3 ms/row at rows {1, 1, 1, 2, 3} (the old fit was NaN by step
    ~9,500): the line is found, and a full batch is priced within 5 % of (3 + 0.3 * 32) / 32."""
    cm = CostModel()
    for k, (ms, prefill, rows) in enumerate(cost_sequences.issue_21()):
        cm.observe(ms, prefill, rows)
        if k % 10_000 == 0:
            assert cm.problem() is None, (k, cm.problem())
    assert cm.problem() is None and cm.resets == 0
    assert abs(cm.decode_step_ms(1) - 3.3) < 0.05
    assert abs(cm.c_decode_ms / ((3.0 + 0.3 * 32) / 32) - 1) < 0.05, cm.c_decode_ms


def _assert_usable(cm: CostModel, c_prefill0: float, c_decode0: float) -> None:
    assert cm.problem() is None, cm.problem()
    assert c_prefill0 / BOUND <= cm.c_prefill_ms <= c_prefill0 * BOUND
    assert c_decode0 / BOUND <= cm.c_decode_ms <= c_decode0 * BOUND
    for rows in (1, cm.max_rows // 2, cm.max_rows):
        assert 0 < cm.decode_step_ms(rows) < math.inf


def _segment(kind: str, length: int, level: float, rows: int, rng: random.Random):
    """`length` observations of one shape (see the property test)."""
    for k in range(length):
        if kind == "constant":
            yield level, 0, rows
        elif kind == "linear":
            r = rng.randint(1, rows)
            yield level * (1 + 0.02 * r) * rng.uniform(0.95, 1.05), 0, r
        elif kind == "bursts":
            r = rows if (k // 64) % 2 else 1
            yield level * (1 + 0.02 * r), 0, r
        elif kind == "outliers":
            yield (level * 1e6 if rng.random() < 0.05 else level / 1e6 if rng.random() < 0.05 else level), 0, rows
        elif kind == "prefill":
            yield level, rng.randint(1, 16_384), 0
        elif kind == "mixed":
            yield level, rng.choice((0, 1, 256)), rng.choice((0, 1, rows))
        else:  # garbage
            yield rng.choice((0.0, -level, math.nan, math.inf, 5e-324, 1e308)), rng.randint(0, 4), rng.randint(0, 64)


@hsettings(max_examples=100, deadline=None)
@given(
    c_prefill0=st.floats(1e-4, 10.0),
    c_decode0=st.floats(1e-3, 100.0),
    max_rows=st.integers(1, 256),
    program=st.lists(
        st.tuples(
            st.sampled_from(("constant", "linear", "bursts", "outliers", "prefill", "mixed", "garbage")),
            st.integers(1, 30_000),
            st.floats(1e-6, 1e7),
            st.integers(1, 256),
        ),
        min_size=1,
        max_size=8,
    ),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_sequence_keeps_the_model_finite_bounded_and_able_to_recover(
    c_prefill0, c_decode0, max_rows, program, seed
):
    """Segments of constant rows, varied rows, bursts, outliers, prefill-only runs, mixed steps
    and garbage (zero, negative, NaN, infinite, denormal and huge times), up to ~10^5 steps an
    example and millions over the run: every estimate stays finite, positive and within
    [1/100, 100] x its configured value after every step. Afterwards 6,000 clean steps of a new
    law are enough for a full batch to be priced within 10 % of it."""
    rng = random.Random(seed)
    cm = CostModel(c_prefill0, c_decode0, max_rows=max_rows)
    lo_d, hi_d = c_decode0 / BOUND, c_decode0 * BOUND
    lo_p, hi_p = c_prefill0 / BOUND, c_prefill0 * BOUND
    for kind, length, level, rows in program:
        for ms, prefill, r in _segment(kind, length, level, min(rows, max_rows), rng):
            cm.observe(ms, prefill, r)
            assert lo_d <= cm.c_decode_ms <= hi_d and lo_p <= cm.c_prefill_ms <= hi_p
        _assert_usable(cm, c_prefill0, c_decode0)
    # A law inside the bounds: a full batch costs 3x the configured price, 60 % of it the base.
    full = 3 * c_decode0 * max_rows
    base, per_row = 0.6 * full, 0.4 * full / max_rows
    for _ in range(6000):
        r = rng.randint(1, max_rows)
        cm.observe((base + per_row * r) * rng.uniform(0.99, 1.01), 0, r)
    _assert_usable(cm, c_prefill0, c_decode0)
    assert abs(cm.c_decode_ms / (3 * c_decode0) - 1) < 0.1, (cm.c_decode_ms, 3 * c_decode0)


def test_long_uptime_sequence_ends_fitted():
    """The e2e test's driving sequence (issue 21's, garbage, issue 21's again) leaves a usable
    model priced at the last law, with no reset needed."""
    cm = CostModel()
    for obs in cost_sequences.long_uptime():
        cm.observe(*obs)
    _assert_usable(cm, 0.1, 1.25)
    assert cm.resets == 0
    assert abs(cm.c_decode_ms / ((3.0 + 0.3 * 32) / 32) - 1) < 0.05, cm.c_decode_ms


def test_an_estimate_that_is_not_finite_falls_back_once_with_one_log_line(caplog):
    """Fail safe: state that is not finite (as if a bug slipped past the bounds) is replaced by
    the configured constants at the next step; the warning is logged once, the resets counted."""
    cm = CostModel(0.1, 1.25)
    for _ in range(100):
        cm.observe(10.0, 0, 4)
    with caplog.at_level(logging.WARNING, logger="ringserve.gpu"):
        for _ in range(3):
            cm._cxy = math.nan  # planted: what the old recursive fit did after ~10^4 steps
            assert cm.problem() is not None
            cm.observe(10.0, 0, 4)
    assert cm.resets == 3 and cm.problem() is None
    assert (cm.c_prefill_ms, cm.c_decode_ms) == (0.1, 1.25)
    assert sum("cost model reset" in r.message for r in caplog.records) == 1


def test_answer_lengths_stay_within_one_and_the_cap():
    """Lengths are clamped to [1, cap] as they arrive, so the mean is too."""
    al = AnswerLengths(initial=300, window=4, cap=1000)
    for tokens in (0, -5, 10**12, 7):
        al.add(tokens)
    assert al.mean == (1 + 1 + 1000 + 7) / 4 and al.problem() is None


def test_the_schedulers_integrity_check_sees_an_unusable_cost_model():
    """`check_integrity` (run after every step in the tests) fails on a non-finite estimate."""
    h = make_harness()
    h.sched.check_integrity()
    h.sched.admission.costs._per_row = math.inf  # planted
    with pytest.raises(SchedulerIntegrityError, match="per_row_ms"):
        h.sched.check_integrity()


def test_a_scheduler_after_a_long_uptime_still_refuses_an_overload():
    """The same burst of 120 max_tokens=2000 ignore_eos requests, on a fresh scheduler and on one
    whose cost model went through the long-uptime sequence: both refuse most of it with 429 and a
    Retry-After (the old fit let the second admit all 120)."""
    refused = []
    for driven in (False, True):
        h = make_harness(num_blocks=4096, queue_limit_s=2.0)
        if driven:
            for obs in cost_sequences.long_uptime():
                h.sched.observe_step_time(*obs)
        decisions = [h.sched.admit(make_request(i, 8, max_tokens=2000, ignore_eos=True)) for i in range(120)]
        assert all(d.status in (200, 429) for d in decisions)
        assert all(d.retry_after_s is not None and d.retry_after_s >= 1 for d in decisions if d.status == 429)
        refused.append(sum(d.status == 429 for d in decisions))
        h.sched.check_integrity()
    assert refused[0] > 60 and refused[1] > 60, refused
