"""Admission: the cost estimate, 400 and 429 with Retry-After, online recalibration."""

import math

from ringserve.gpu_proc.admission import RETRY_AFTER_MAX_S, AdmissionController


def test_estimate_uses_seed_constants_and_recent_answer_length():
    """est = prompt*0.1 + min(max_tokens, avg answer)*1.25 ms; the average starts at 300."""
    ac = AdmissionController()
    assert math.isclose(ac.estimate_ms(1250, 1000), 125 + 300 * 1.25, rel_tol=1e-3)
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


def test_retry_after_is_whole_seconds_capped_at_a_minute():
    """A projected drain of hours (or one that is not a number) is sent as 60 s, which clients honour."""
    ac = AdmissionController()
    assert ac.decide(1000, 300, 1, queued_ms=1900, row_wait_ms=lambda: 3.6e6).retry_after_s == RETRY_AFTER_MAX_S
    assert ac.decide(1000, 300, 1, queued_ms=1900, row_wait_ms=lambda: float("nan")).retry_after_s == 60


def test_waiting_work_that_is_not_a_number_refuses():
    """Fail closed: a NaN waiting-work total counts as a full queue, never as an empty one."""
    d = AdmissionController().decide(10, 10, 1, queued_ms=float("nan"))
    assert d.status == 429 and d.retry_after_s is not None


def test_a_request_sure_to_run_long_is_priced_at_its_length():
    """Recent answers of 5 tokens do not make a max_tokens=2000 ignore_eos request look like 5 tokens."""
    ac = AdmissionController()
    for _ in range(300):
        ac.observe_answer(5)
    assert ac.estimate_ms(10, 2000) == 10 * 0.1 + 5 * 1.25
    assert ac.estimate_ms(10, 2000, floor_tokens=2000) == 10 * 0.1 + 2000 * 1.25
    assert ac.decide(10, 2000, 1, queued_ms=100, floor_tokens=2000).status == 429
