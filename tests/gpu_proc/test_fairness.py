"""Fair queue: fewest weighted tokens served goes next, per-key row cap, preempted go first."""

import pytest

from ringserve.gpu_proc.fairness import FairQueue
from ringserve.gpu_proc.request import Request
from ringserve.shm.messages import SamplingParams


def _req(rid, tenant, max_tokens=10):
    return Request(
        key=(0, rid),
        request_id=str(rid),
        tenant=tenant,
        prompt_ids=[1, 2],
        max_tokens=max_tokens,
        sampling=SamplingParams(),
        arrival_ts=0.0,
        deadline_ts=1e9,
    )


def _join(q, req, rows=1):
    q.rows_started(req.tenant, rows)
    q.pop(req)


def test_fifo_within_a_key():
    """One key's requests join in arrival order."""
    q = FairQueue()
    reqs = [_req(i, "a") for i in range(3)]
    for r in reqs:
        q.push(r)
    order = []
    while (r := q.peek()) is not None:
        order.append(r)
        _join(q, r)
    assert order == reqs and len(q) == 0


def test_fewest_weighted_tokens_served_goes_next():
    """A key that was served more waits; output tokens weigh 12 prompt tokens."""
    q = FairQueue(output_token_weight=12)
    a0, b0 = _req(0, "a"), _req(1, "b")
    q.push(a0)
    q.push(b0)
    q.charge("a", 100, 0)  # a: 100
    q.charge("b", 0, 10)  # b: 120
    assert q.peek() is a0
    q.charge("a", 0, 2)  # a: 124
    assert q.peek() is b0


def test_declared_max_tokens_does_not_matter():
    """A short declared answer gains no priority over an equal-served key."""
    q = FairQueue()
    long_, short = _req(0, "a", max_tokens=1000), _req(1, "b", max_tokens=1)
    q.push(long_)
    q.push(short)
    q.charge("b", 1, 0)
    assert q.peek() is long_


def test_row_cap_applies_only_while_others_wait():
    """A key at 8 rows is passed over while another key waits, and not otherwise."""
    q = FairQueue(tenant_row_cap=8)
    a = [_req(i, "a") for i in range(10)]
    for r in a:
        q.push(r)
    for r in a[:8]:
        _join(q, r)
    assert q.peek() is a[8]  # only key a waits: the cap does not bind
    b = _req(100, "b")
    q.push(b)
    q.charge("b", 10_000, 0)  # b served far more, but a is at its cap
    assert q.peek() is b


def test_preempted_request_goes_to_the_front_of_its_key():
    """push_front puts a preempted request ahead of its key's queue."""
    q = FairQueue()
    r0, r1 = _req(0, "a"), _req(1, "a")
    q.push(r0)
    _join(q, r0)
    q.push(r1)
    q.push_front(r0)
    q.rows_ended("a", 1)
    assert q.peek() is r0


def test_new_key_starts_at_the_least_served_active_key():
    """A key that becomes active starts level with the least-served active key, not at zero."""
    q = FairQueue()
    a = _req(0, "a")
    q.push(a)
    _join(q, a)
    q.charge("a", 5000, 0)
    q.push(_req(1, "b"))
    assert q.usage("b").weighted_tokens_served == 5000
    q.rows_ended("a", 1)
    assert q.usage("a") is None  # idle keys are forgotten


def test_remove_and_pop_errors():
    """remove() of a non-queued request is False; pop() of a non-head request raises."""
    q = FairQueue()
    r0, r1 = _req(0, "a"), _req(1, "a")
    q.push(r0)
    q.push(r1)
    assert q.remove(r1) and not q.remove(r1)
    assert len(q) == 1
    with pytest.raises(ValueError):
        q.pop(r1)


def test_integrity_check_catches_row_miscount():
    """check_integrity compares per-key rows with what the scheduler holds."""
    q = FairQueue()
    r = _req(0, "a")
    q.push(r)
    _join(q, r, rows=2)
    q.check_integrity({"a": 2})
    with pytest.raises(ValueError):
        q.check_integrity({"a": 1})
    with pytest.raises(ValueError):
        q.check_integrity({"a": 2, "b": 1})
