"""Crash attribution in the supervisor (`ringserve/suspects.py`): strikes, quarantine, and which
GPU-process deaths count toward the restart limit."""

from __future__ import annotations

from ringserve.restart_policy import RestartPolicy
from ringserve.shm.in_flight import InFlight
from ringserve.suspects import MAX_SUSPECTS, STRIKES_TO_QUARANTINE, TENANT_STRIKES, Suspects

QUARANTINE_S = 600.0


def _suspects() -> Suspects:
    return Suspects(quarantine_s=QUARANTINE_S, window_s=60.0)


def _req(fp: int, tenant: int = 1, rid: int | None = None) -> InFlight:
    return InFlight(slot=0, rid=rid if rid is not None else fp, fingerprint=fp, tenant=tenant)


def test_request_in_the_step_at_two_deaths_is_quarantined_and_the_second_does_not_count():
    """First death with a fresh request: it counts and strikes it once. The same request again (a
    resubmission, another rid): quarantined until QUARANTINE_S after, and not counted."""
    s = _suspects()
    first = s.death(100.0, [_req(0xA, rid=1)])
    assert first.counts and first.struck == (0xA,) and first.quarantined == ()
    assert s.quarantine(100.0) == []
    second = s.death(105.0, [_req(0xA, rid=2)])
    assert not second.counts and second.quarantined == (0xA,)
    assert s.quarantine(106.0) == [(0xA, 105.0 + QUARANTINE_S)]
    assert s.quarantine(105.0 + QUARANTINE_S) == []


def test_innocent_requests_of_a_blamed_step_are_struck_once_only():
    """A request in the step beside a suspect takes one strike; only a second death in the step
    would quarantine it."""
    s = _suspects()
    s.death(0.0, [_req(0xA)])
    verdict = s.death(1.0, [_req(0xA), _req(0xB, tenant=2)])
    assert verdict.quarantined == (0xA,) and set(verdict.struck) == {0xA, 0xB}
    assert [fp for fp, _ in s.quarantine(2.0)] == [0xA]


def test_death_with_nothing_in_the_step_always_counts():
    """Loading, idle, between steps, or a synthetic step of no client's (fingerprint 0, the
    start-up calibration): the server is suspect, every such death counts."""
    s = _suspects()
    assert all(s.death(float(t), []).counts for t in range(10))
    assert all(s.death(float(t), [_req(0, rid=t)]).counts for t in range(10, 20))
    assert s.quarantine(20.0) == []


def test_one_tenant_cannot_push_the_count_to_the_limit():
    """One tenant sending fresh poison requests one after another: after TENANT_STRIKES deaths with
    its requests in the step, its next ones stop counting; a restart limit above that is never
    reached, while another tenant's fresh death still counts."""
    s = _suspects()
    policy = RestartPolicy(limit=TENANT_STRIKES + 1, window_s=60.0)
    now = 0.0
    for poison in range(1, 20):
        for _ in range(STRIKES_TO_QUARANTINE):  # each is resubmitted once, then quarantined
            verdict = s.death(now, [_req(poison, tenant=7)])
            assert policy.crashed(now, counts=verdict.counts) is not None, f"gave up at poison {poison}"
            now += 1.0
    assert policy.recent <= TENANT_STRIKES
    assert s.death(now, [_req(999, tenant=8)]).counts


def test_strikes_are_forgotten_after_the_quarantine():
    """A strike older than QUARANTINE_S no longer makes the request a suspect."""
    s = _suspects()
    s.death(0.0, [_req(0xA, tenant=1)])
    verdict = s.death(QUARANTINE_S + 1.0, [_req(0xA, tenant=1)])
    assert verdict.counts and verdict.quarantined == ()


def test_tables_stay_bounded_and_keep_quarantines_longest():
    """However many requests were struck, at most MAX_SUSPECTS are remembered; single strikes are
    dropped before quarantines."""
    s = _suspects()
    s.death(0.0, [_req(1)])
    s.death(0.5, [_req(1)])  # quarantined
    for i in range(MAX_SUSPECTS + 50):
        s.death(1.0 + i * 1e-3, [_req(1000 + i, tenant=1000 + i)])
    assert len(s.strikes) <= MAX_SUSPECTS and len(s.tenant_deaths) <= MAX_SUSPECTS
    assert [fp for fp, _ in s.quarantine(2.0)] == [1]


def test_uncounted_crash_still_backs_off():
    """A death that does not count toward the limit still lengthens the backoff streak."""
    p = RestartPolicy(limit=2, window_s=60.0)
    assert p.crashed(0.0) == 0.25
    assert p.crashed(1.0, counts=False) == 0.5
    assert p.crashed(2.0, counts=False) == 1.0
    assert p.recent == 1
    assert p.crashed(3.0) is None
