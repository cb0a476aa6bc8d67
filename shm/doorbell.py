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
    """One eventfd, read by one process (the bell's consumer) and rung by any number.

    The descriptor is made *blocking*: `wait(None)` is then a single blocking `read`, the
    cheapest wake-up the kernel offers (about 2 us less per round trip than poll + read on
    this class of machine). Every other read happens only after `poll` reports the counter
    non-zero, so nothing else ever blocks; writes of 1 cannot block in practice (the counter
    would have to reach 2**64 - 2). The open file description is shared with every process
    that inherited it, so code here also works when another process (an event loop) has
    switched it to non-blocking.
    """

    __slots__ = ("_fd", "_poll", "_owned")

    def __init__(self, fd: int, owned: bool = True):
        os.set_blocking(fd, True)
        self._fd = fd
        self._owned = owned
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)

    @classmethod
    def create(cls) -> Doorbell:
        """A fresh inheritable eventfd."""
        fd = os.eventfd(0, 0)
        os.set_inheritable(fd, True)
        return cls(fd)

    @classmethod
    def from_fd(cls, fd: int) -> Doorbell:
        """Wrap an inherited eventfd."""
        return cls(fd)

    def fileno(self) -> int:
        return self._fd

    def ring(self) -> None:
        """Wake the waiter. Never blocks."""
        try:
            os.eventfd_write(self._fd, 1)
        except BlockingIOError:
            pass  # counter at its maximum (non-blocking description): the waiter will wake

    def drain(self) -> int:
        """Clear pending rings without blocking; return how many there were (0 if none)."""
        if not self._poll.poll(0):
            return 0
        return self._read()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until rung or `timeout` seconds pass (None: forever); drain; True if rung."""
        if timeout is None:
            try:
                return os.eventfd_read(self._fd) > 0  # EINTR is retried by Python (PEP 475)
            except BlockingIOError:
                # The description is shared with other processes, and an event loop there
                # (libuv sets O_NONBLOCK on fds it polls) may have made it non-blocking.
                ms = -1
        else:
            ms = max(0, int(timeout * 1000 + 0.999))
        if not self._poll.poll(ms):
            return False
        return self._read() > 0

    def _read(self) -> int:
        try:
            return os.eventfd_read(self._fd)
        except BlockingIOError:  # drained by someone else between poll and read
            return 0

    def close(self) -> None:
        if self._fd >= 0 and self._owned:
            os.close(self._fd)
        self._fd = -1

    def __repr__(self) -> str:
        return f"Doorbell(fd={self._fd})"
