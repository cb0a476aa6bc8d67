"""systemd's notify protocol (`sd_notify(3)`): datagrams of `KEY=value` lines to `$NOTIFY_SOCKET`.

Written by hand rather than taken from a library: the protocol is one `sendto` on an AF_UNIX
datagram socket (abstract when the path starts with `@`), the maintained packages either wrap
libsystemd through C bindings (a build dependency on servers that may lack the headers) or add a
dependency for these dozen lines, and the supervisor must stay importable without either.
Outside systemd (`NOTIFY_SOCKET` unset) every call is a no-op, so callers never check.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger("ringserve.sdnotify")


class Notifier:
    """Sends notifications to the service manager, if one asked for them."""

    def __init__(self, address: str | None = None) -> None:
        address = os.environ.get("NOTIFY_SOCKET") if address is None else address
        self.address: str | None = None
        self._sock: socket.socket | None = None
        if not address:
            return
        if address[0] not in "/@":
            raise ValueError(f"NOTIFY_SOCKET must be an absolute path or an abstract name (@...), got {address!r}")
        # An abstract socket name starts with a NUL byte; systemd writes it as '@'.
        self.address = "\0" + address[1:] if address[0] == "@" else address
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC)
        # NOTE: never block: a unix datagram send waits while the receiver's queue is full, and
        # the supervision loop must not stall on a busy (or fake) service manager.
        self._sock.setblocking(False)

    @property
    def enabled(self) -> bool:
        return self._sock is not None

    def notify(self, **fields: object) -> bool:
        """Send `KEY=value` lines (keyword names upper-cased); True when a datagram went out.

        A failed send is logged, never raised: a lost notification must not take the server down
        (systemd's watchdog then acts, which is what it is for).
        """
        if self._sock is None or self.address is None:
            return False
        payload = "\n".join(f"{key.upper()}={value}" for key, value in fields.items()).encode()
        try:
            self._sock.sendto(payload, self.address)
        except OSError as exc:
            log.warning("sd_notify to %r failed: %s", self.address, exc)
            return False
        return True

    def ready(self, status: str) -> bool:
        return self.notify(ready=1, status=status)

    def status(self, status: str) -> bool:
        return self.notify(status=status)

    def watchdog(self) -> bool:
        return self.notify(watchdog=1)

    def extend_timeout(self, seconds: float, status: str | None = None) -> bool:
        """Ask for `seconds` more before systemd's start (or stop) timeout fires."""
        fields: dict[str, object] = {"extend_timeout_usec": int(seconds * 1e6)}
        if status is not None:
            fields["status"] = status
        return self.notify(**fields)

    def stopping(self, status: str) -> bool:
        return self.notify(stopping=1, status=status)

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def watchdog_interval_s() -> float | None:
    """Half of systemd's `WatchdogSec` (how often to send WATCHDOG=1), or None when not asked.

    `WATCHDOG_PID`, when set, names the process that must send; any other process ignores it.
    """
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid.isdigit() and int(pid) != os.getpid()):
        return None
    try:
        value = int(usec)
    except ValueError:
        return None
    return value / 2e6 if value > 0 else None
