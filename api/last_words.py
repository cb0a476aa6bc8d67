"""A worker about to be killed ends its requests with an explicit error (docs/design.md#failures).

The supervisor kills a worker whose heartbeat went stale (its event loop stopped turning), and a
killed process's connections die with it: its clients would see a reset, an SSE stream cut with
no error event and no [DONE]. So it warns first: SIGCONT (a SIGSTOPped worker runs no handler
until it is continued) and SIGUSR1, then SIGKILL `LAST_WORDS_S` later. The
handler here is a plain signal handler, not the event loop's (the loop is what is stuck): Python
runs it in the main thread at the stuck code's next bytecode. It writes, straight to each socket,
what ends each open request — an error event (`worker_restart`, with the tokens streamed) and
[DONE] on a stream, a 503 JSON answer where no response has started — and exits.

Only a connection with nothing queued in its transport is written to (bytes behind queued ones
would come out first and break the framing); the others are reset as before. A worker killed
without warning (the OOM killer, SIGKILL by hand) or stuck inside one long C call cannot answer:
its clients see the reset.
"""

from __future__ import annotations

import logging
import os
import signal

import msgspec

from ringserve.api.errors import error_object
from ringserve.api.registry import Registry

log = logging.getLogger("ringserve.api.last_words")

LAST_WORDS_S = 1.0  # the supervisor's wait between SIGUSR1 and SIGKILL
CODE = "worker_restart"
MESSAGE = (
    "The API worker serving this request stopped responding and is being restarted; "
    "the request was not finished. Retry it."
)


def install(registry: Registry) -> None:
    """SIGUSR1 ends every open request of `registry` with the error and exits (main thread only)."""

    def on_signal(signum, frame) -> None:
        ended = say_last_words(registry)
        log.error("told to stop (unresponsive): ended %d of %d open requests with an error", ended, len(registry))
        os._exit(1)

    signal.signal(signal.SIGUSR1, on_signal)


def say_last_words(registry: Registry) -> int:
    """Write each open request's ending to its socket; how many got one."""
    answer = msgspec.json.encode(error_object(MESSAGE, CODE, type_=CODE))
    http = (
        b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\nConnection: close\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(answer), answer)
    )
    ended = 0
    for entry in list(registry.values()):
        transport = entry.transport
        if transport is None or transport.is_closing() or transport.get_write_buffer_size():
            continue
        sock = transport.get_extra_info("socket")
        if sock is None:
            continue
        data = entry.farewell(CODE, MESSAGE) if entry.farewell is not None else http
        try:
            ended += os.write(sock.fileno(), data) == len(data)
        except OSError:
            pass  # the client is gone, or its socket buffer is full: it gets the reset
    return ended
