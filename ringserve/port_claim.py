"""One server per port: a second `ringserve serve` on a port in use refuses to start.

The API workers bind with SO_REUSEPORT so the kernel spreads connections between them; the same
option would let a second instance of the same user join the port and take half its traffic. So
before anything else the supervisor (1) claims the port in the Linux abstract socket namespace,
which only one process can hold and which goes away with it, so two instances started together
cannot both pass; and (2) binds the port once *without* SO_REUSEPORT, which fails while anything
(another ringserve, another program) listens there.
"""

from __future__ import annotations

import errno
import socket


class PortInUse(RuntimeError):
    """The port is taken; the message says by what, as far as we can tell."""


def claim_port(host: str, port: int) -> socket.socket:
    """Claim `port` for this process, or raise PortInUse. Keep the returned socket open for as
    long as the server runs (it is the claim; it is not inherited by children)."""
    claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        claim.bind(f"\0ringserve.port.{port}")
    except OSError as exc:
        claim.close()
        if exc.errno != errno.EADDRINUSE:
            raise
        raise PortInUse(
            f"port {port} is already served by another ringserve on this host; stop it or choose another --port"
        ) from None
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT leftovers are fine
        try:
            probe.bind((host, port))
        except OSError as exc:
            claim.close()
            if exc.errno != errno.EADDRINUSE:
                raise
            raise PortInUse(
                f"port {port} on {host} is already in use by another process; stop it or choose another --port"
            ) from None
    return claim
