"""Doorbells: eventfds that wake a sleeping ring consumer.

The supervisor creates them (inheritable, non-blocking) and children receive them through
`pass_fds` / fork. A producer pushes its records, then `ring()`s once; the eventfd counter adds
up, so any number of rings on one bell (all request rings share the GPU process's input bell)
coalesce into a single wake-up that `drain()` clears. The consumer either registers `fileno()`
with `loop.add_reader` (asyncio) or calls `wait(timeout)` from a blocking loop.

NOTE: always drain, then pop until the ring is empty, then wait: a bell rung between the pop and
the wait is kept in the counter, so no wake-up is lost.
"""

from __future__ import annotations

import os
import select


class Doorbell:
    """One eventfd. Not thread-safe to close while another thread waits on it."""

    __slots__ = ("_fd", "_poll", "_owned")

    def __init__(self, fd: int, owned: bool = True):
        self._fd = fd
        self._owned = owned
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls) -> "Doorbell":
        """A fresh inheritable, non-blocking eventfd."""
        fd = os.eventfd(0, os.EFD_NONBLOCK)
        os.set_inheritable(fd, True)
        return cls(fd)

    @classmethod
    def from_fd(cls, fd: int) -> "Doorbell":
        """Wrap an inherited eventfd (made non-blocking here, whatever the parent did)."""
        os.set_blocking(fd, False)
        return cls(fd)

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        """Wake the waiter. Never blocks."""
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:
            pass  # the counter is at its maximum: the waiter is certainly going to wake

    def drain(self) -> int:
        """Clear pending rings; return how many there were (0 if none)."""
        try:
            return os.eventfd_read(self._fd)
        except BlockingIOError:
            return 0

    def wait(self, timeout: float | None = None) -> bool:
        """Block until rung or `timeout` seconds pass (None: forever); drain; True if rung."""
        ms = -1 if timeout is None else max(0, int(timeout * 1000 + 0.999))
        if not self._poll.poll(ms):  # EINTR is retried by Python (PEP 475)
            return False
        try:
            return os.eventfd_read(self._fd) > 0
        except BlockingIOError:  # another reader drained it first
            return False

    def close(self) -> None:
        if self._fd >= 0 and self._owned:
            os.close(self._fd)
        self._fd = -1

    def __repr__(self) -> str:
        return f"Doorbell(fd={self._fd})"
