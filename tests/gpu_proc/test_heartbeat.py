"""The GPU loop's heartbeat (`gpu_proc/heartbeat.py`) on real threads: a long pass that computes
keeps beating, a blocked one and one past the cap do not."""

from __future__ import annotations

import threading
import time

import pytest

from ringserve.gpu_proc.heartbeat import LoopHeartbeat

EVERY_S = 0.05


def _burn(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        sum(range(1000))


def _longest_gap(beats: list[float], since: float, until: float) -> float:
    """The longest time without a beat within [since, until]."""
    points = [since] + [t for t in beats if since <= t <= until] + [until]
    return max(b - a for a, b in zip(points, points[1:]))


def _pass(work, cap_s: float = 30.0) -> tuple[list[float], float, float]:
    """One loop pass doing `work` under the monitor: (beat times, pass start, pass end)."""
    beats: list[float] = []
    hb = LoopHeartbeat(lambda: beats.append(time.monotonic()), cap_s=cap_s, warn_after_s=0.2, every_s=EVERY_S)
    with hb.watching():
        hb.beat()
        start = time.monotonic()
        work()
        end = time.monotonic()
    return beats, start, end


def test_a_long_pass_that_computes_keeps_beating(caplog):
    """1.5 s of CPU work in one pass: the monitor beats throughout (no gap near a watchdog), and
    says once that the pass is long but computing."""
    beats, start, end = _pass(lambda: _burn(1.5))
    assert _longest_gap(beats, start, end) < 0.5
    assert sum("still computing" in r.message for r in caplog.records) == 1


def test_a_blocked_pass_stops_beating():
    """A pass waiting on a lock (a deadlock, a future) uses no CPU time: no beat after it began."""
    blocker = threading.Event()
    beats, start, end = _pass(lambda: blocker.wait(1.0))
    assert not [t for t in beats if start + 2 * EVERY_S < t < end]


def test_a_pass_whose_helper_computes_does_not_beat():
    """The loop waits while another thread computes (a grammar compile): the CPU time that counts is
    the loop thread's own, so nothing vouches for it."""

    def wait_for_helper() -> None:
        helper = threading.Thread(target=_burn, args=(1.0,))
        helper.start()
        helper.join()

    beats, start, end = _pass(wait_for_helper)
    assert not [t for t in beats if start + 2 * EVERY_S < t < end]


def test_a_pass_polling_a_future_does_not_beat():
    """The loop waits for a result in short timed waits (a poll every 2 ms): it wakes, so its CPU
    clock advances, but by a sliver: nothing vouches for it."""
    never = threading.Event()

    def poll() -> None:
        end = time.monotonic() + 1.0
        while time.monotonic() < end and not never.wait(0.002):
            pass

    beats, start, end = _pass(poll)
    assert not [t for t in beats if start + 2 * EVERY_S < t < end]


@pytest.mark.parametrize("cap_s", [0.5])
def test_a_pass_past_the_cap_stops_beating(cap_s):
    """A busy endless loop computes forever: beats stop once the pass is older than the cap."""
    beats, start, end = _pass(lambda: _burn(1.5), cap_s=cap_s)
    assert [t for t in beats if start < t < start + cap_s - EVERY_S]
    assert not [t for t in beats if start + cap_s + EVERY_S < t < end]
