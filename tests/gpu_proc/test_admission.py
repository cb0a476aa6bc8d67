"""Admission: the cost estimate, 400 and 429 with Retry-After, online recalibration."""

import math
import random

from ringserve.gpu_proc.admission import AdmissionController, AnswerLengths, CostModel


def test_estimate_uses_seed_constants_and_recent_answer_length():
    """est = prompt*0.1 + min(max_tokens, avg answer)*1.25 ms; the average starts at 300."""
    ac = AdmissionController()
    assert math.isclose(ac.estimate_ms(1250, 1000), 125 + 300 * 1.25)
    assert math.isclose(ac.estimate_ms(1250, 100), 125 + 100 * 1.25)
    for _ in range(10):
        ac.observe_answer(20)
    assert math.isclose(ac.estimate_ms(100, 1000, n=2), 10 + 2 * 20 * 1.25)


def test_over_context_limit_is_400():
    """prompt + max_tokens over 8,192 is refused with a message naming both numbers."""
    d = AdmissionController().decide(8000, 193, 1, queued_ms=0)
    assert d.status == 400 and d.code == "context_length_exceeded"
    assert "8000 tokens" in d.message and "(193)" in d.message and "8192" in d.message
    assert AdmissionController().decide(8000, 192, 1, queued_ms=0).accepted


def test_other_400s():
    """max_tokens over its limit (when one is set), n over the row cap and a pool too small are 400."""
    assert AdmissionController(max_rows=4).decide(10, 5000, 1, 0).accepted  # no limit but the context
    ac = AdmissionController(max_rows=4, max_tokens_limit=1000)
    assert ac.decide(10, 1001, 1, 0).code == "max_tokens_too_large"
    assert ac.decide(10, 10, 5, 0).code == "n_too_large"
    assert ac.decide(10, 10, 1, 0, pool_fits=False).code == "too_large_for_kv_pool"


def test_over_two_seconds_queued_is_429_with_retry_after():
    """Queued work plus this request over 2 s is 429; Retry-After is the time for the queue
    ahead to drain (plus the wait for a row when none frees sooner), in whole seconds."""
    ac = AdmissionController()
    assert ac.estimate_ms(1000, 300) == 475  # 100 + 375 ms
    assert ac.decide(1000, 300, 1, queued_ms=1500).accepted
    d = ac.decide(1000, 300, 1, queued_ms=1600)
    assert d.status == 429 and d.retry_after_s == 2.0
    d = ac.decide(1000, 300, 1, queued_ms=4000, row_wait_ms=lambda: 2500.0)
    assert d.retry_after_s == math.ceil((4000 + 2500) / 1000)


def test_empty_queue_always_admits():
    """A request costlier than the limit on its own is slow, not refused."""
    assert AdmissionController().decide(8000, 192, 1, queued_ms=0).accepted


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
