"""When to restart a crashed child, and whether ever to stop trying.

Exponential backoff keeps a child that fails at once from spinning the CPU (and the log). By
default the supervisor never gives up: the API stays up answering 503 with the last GPU error and
a Retry-After, and a fault that clears (a driver reset, a model directory back in place) is
recovered without anyone acting. With `limit` N it gives up after N crashes within `window_s`
and exits non-zero, for a service manager that can do what an in-place restart cannot (a fresh
cgroup, a reboot, paging someone): the systemd unit uses that. A GPU-process death blamed on a
request already suspect (`suspects.py`) is restarted like any other but not counted toward N: the
limit counts what the server did, not what a request did to it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKOFF_BASE_S = 0.25  # first restart delay; doubles with each crash of a streak
BACKOFF_MAX_S = 30.0


@dataclass(slots=True)
class RestartPolicy:
    """Crash accounting for one child. A streak is a run of crashes each within `window_s` of the
    one before; the backoff doubles along a streak (so it stays at the cap in a crash loop however
    long each attempt takes), and a child that ran for a whole window starts a new streak."""

    limit: int  # 0: never give up
    window_s: float
    crashes: list[float] = field(default_factory=list)  # counted ones, within window_s of the last crash
    streak: int = 0
    last_crash: float | None = None  # counted or not
    restart_at: float | None = None  # while the child is down: when to start it again

    def crashed(self, now: float, counts: bool = True) -> float | None:
        """The child went down at `now`: the backoff, with `restart_at` set, or None to give up."""
        backoff = self.record_crash(now, counts)
        self.restart_at = None if backoff is None else now + backoff
        return backoff

    def due(self, now: float) -> bool:
        """The child is down and its backoff has passed."""
        return self.restart_at is not None and now >= self.restart_at

    def record_crash(self, now: float, counts: bool = True) -> float | None:
        """A crash at `now` (toward the limit when `counts`); the backoff before the restart, or
        None to give up. Every crash lengthens the streak, so the backoff grows either way."""
        last = self.last_crash
        self.streak = self.streak + 1 if last is not None and now - last <= self.window_s else 1
        self.last_crash = now
        self.crashes = [t for t in self.crashes if now - t <= self.window_s] + ([now] if counts else [])
        if counts and self.limit and len(self.crashes) >= self.limit:
            return None
        return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (self.streak - 1))

    @property
    def recent(self) -> int:
        return len(self.crashes)
