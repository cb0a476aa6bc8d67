"""The GPU loop's heartbeat, which tells a long step that is still working from a hung one
(`docs/design.md#failure-semantics`).

The loop beats once per pass. A pass normally takes milliseconds, but one step can take seconds
on a slow or contended machine (a 2,048-token prefill on two busy CPU cores passed 10 s), and the
supervisor's watchdog (`--watchdog-timeout-s`) must not kill a step for being slow. So while a
pass runs, a monitor thread beats for the loop as long as the loop thread's own CPU time advances
by at least `COMPUTING_SHARE` of the wall time between two looks (its thread CPU clock,
`pthread_getcpuclockid`), up to a hard cap on the pass (`--watchdog-step-cap-s`):

    loop blocked (a deadlock, a wait on a lock or a future)   no CPU time: no beat -> killed
    loop waking now and then while blocked (a poll, a join)   a sliver of CPU: no beat -> killed
    process stopped (SIGSTOP), or the monitor cannot run      nothing beats -> killed
    loop computing, however slowly                            beats until the pass reaches the cap
    loop in a busy endless loop                               beats until the cap -> killed after it

The CPU clock is the loop thread's own, not the process's: a helper thread that computes while
the loop waits for it (a grammar compile) does not vouch for the loop.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

log = logging.getLogger("ringserve.gpu")

MONITOR_EVERY_S = 0.25  # the monitor's period: a stale beat is at most this much older than progress
# NOTE: a computing loop thread gets a core, or a share of one on a contended box (a quarter at
# load 8 on 2 cores); a blocked one only wakes for microseconds (a join returning, a timed wait)
COMPUTING_SHARE = 0.1


class LoopHeartbeat:
    """`beat()` from the loop thread once per pass; `watching()` around the loop runs the monitor.
    `emit` writes the heartbeat the supervisor reads (`Control.gpu_heartbeat`)."""

    def __init__(
        self,
        emit: Callable[[], None],
        cap_s: float,
        warn_after_s: float,
        every_s: float = MONITOR_EVERY_S,
    ) -> None:
        self.emit = emit
        self.cap_s = cap_s
        self.warn_after_s = warn_after_s  # the watchdog's timeout: a pass longer than this is logged
        self.every_s = every_s
        self.vouched = 0  # beats the monitor sent for a pass (tests and logs)
        self._pass_start = time.monotonic()
        self._done = threading.Event()

    def beat(self) -> None:
        """The loop finished a pass (or is idle): beat, and start timing the next pass."""
        self._pass_start = time.monotonic()
        self.emit()

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Run the monitor for the calling thread (the loop's) until the block ends."""
        clock = time.pthread_getcpuclockid(threading.get_ident())
        self._done.clear()
        monitor = threading.Thread(target=self._monitor, args=(clock,), name="loop-heartbeat", daemon=True)
        monitor.start()
        try:
            yield
        finally:
            self._done.set()
            monitor.join()

    def _monitor(self, clock: int) -> None:
        cpu, wall = time.clock_gettime(clock), time.monotonic()
        warned = None  # the pass already logged as long
        while not self._done.wait(self.every_s):
            now_cpu, now = time.clock_gettime(clock), time.monotonic()
            start = self._pass_start
            running_s = now - start
            if now_cpu - cpu >= COMPUTING_SHARE * (now - wall) and running_s < self.cap_s:
                self.emit()
                self.vouched += 1
                if running_s > self.warn_after_s and warned != start:
                    warned = start
                    log.warning(
                        "a GPU-loop pass has run for %.1f s, past the watchdog's %.0f s, and is still computing "
                        "(%.1f s of its thread's CPU time in the last %.2f s): not a hang; beating for it up to "
                        "%.0f s (--watchdog-step-cap-s)",
                        running_s,
                        self.warn_after_s,
                        now_cpu - cpu,
                        self.every_s,
                        self.cap_s,
                    )
            cpu, wall = now_cpu, now
