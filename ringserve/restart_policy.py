"""When to restart a crashed child, and when to stop trying.

Exponential backoff keeps a child that fails at once from spinning the CPU (and the log); the
crash-loop limit hands a persistent failure to the service manager, which can do what an
in-place restart cannot (a fresh cgroup, a reboot, paging someone).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BACKOFF_BASE_S = 0.25  # first restart delay; doubles with each crash in the window
BACKOFF_MAX_S = 10.0


@dataclass(slots=True)
class RestartPolicy:
    """Crash accounting for one child: restart with exponential backoff, give up after `limit`
    crashes within `window_s` seconds (a crash loop is for systemd, not for us, to handle)."""

    limit: int
    window_s: float
    crashes: list[float] = field(default_factory=list)

    def record_crash(self, now: float) -> float | None:
        """Count a crash at `now`; the backoff before the restart, or None to give up."""
        self.crashes = [t for t in self.crashes if now - t <= self.window_s] + [now]
        if len(self.crashes) >= self.limit:
            return None
        return min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (len(self.crashes) - 1))

    @property
    def recent(self) -> int:
        return len(self.crashes)
