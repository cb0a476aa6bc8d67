"""The log lines aiohttp and asyncio write for a worker carry no request data, and a flood of them
is one line per period (docs/operations.md#logs).

aiohttp logs a request it cannot parse, or a handler's exception, at ERROR with the exception, and
the exception's text quotes the request: a bare-LF request's whole head and body (the
`Authorization` line with its key, the prompt), a header with a control byte in it. `SafeLog`
rewrites those records before any handler sees them: the exception's type and traceback stay (the
frames are our code's lines, never its values), its message does not. It also lets through one
record per `LOG_EVERY_S` for each kind (logger, message, exception type), saying how many it
stood for, so 500 bad requests a second write one line every few seconds, not megabytes.
"""

from __future__ import annotations

import logging
import time
import traceback

from aiohttp.http_exceptions import HttpProcessingError

# The loggers whose records can quote a request (`aiohttp.log`; asyncio's "exception in callback").
LOGGERS = ("aiohttp.server", "aiohttp.web", "aiohttp.internal", "aiohttp.access", "asyncio")
LOG_EVERY_S = 5.0


class SafeLog(logging.Filter):
    """Rewrites a record to its template, its arguments' types, and its exception's type and
    frames; drops repeats within `every_s` of the last one of their kind."""

    def __init__(self, every_s: float = LOG_EVERY_S, clock=time.monotonic) -> None:
        super().__init__()
        self.every_s = every_s
        self.clock = clock
        self._last: dict[tuple, float] = {}
        self._dropped: dict[tuple, int] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        kind = (record.name, str(record.msg), type(exc).__name__ if exc is not None else None)
        now = self.clock()
        last = self._last.get(kind)
        if last is not None and now - last < self.every_s:
            self._dropped[kind] = self._dropped.get(kind, 0) + 1
            return False
        if len(self._last) > 1024:  # kinds are few; a bound all the same
            self._last.clear()
            self._dropped.clear()
        self._last[kind] = now
        dropped = self._dropped.pop(kind, 0)
        text = _safe_message(record)
        if exc is not None:
            text += f": {type(exc).__name__} (its text is not logged: it can quote the request)"
            tb = record.exc_info[2] if record.exc_info else None
            if tb is not None and not isinstance(exc, (HttpProcessingError, ConnectionError)):
                # a handler's own failure: its frames help (a malformed request's do not)
                text += "\nTraceback (most recent call last):\n" + "".join(traceback.format_tb(tb)).rstrip()
        if dropped:
            text += f" [{dropped} more like it in the last {self.every_s:g} s not logged]"
        record.msg, record.args = text, ()
        record.exc_info, record.exc_text, record.stack_info = None, None, None
        return True


def _safe_message(record: logging.LogRecord) -> str:
    """The message with its arguments when they are a peer address or numbers, else their types."""
    args = record.args if isinstance(record.args, tuple) else ()
    safe = tuple(a if isinstance(a, (int, float)) or _is_address(a) else f"<{type(a).__name__}>" for a in args)
    try:
        return str(record.msg) % safe if safe else str(record.msg)
    except (TypeError, ValueError):
        return str(record.msg)


def _is_address(value: object) -> bool:
    return isinstance(value, str) and len(value) <= 64 and all(c in "0123456789abcdefABCDEF.:[]" for c in value)


def install(every_s: float = LOG_EVERY_S) -> SafeLog:
    """Attach one `SafeLog` to every logger in `LOGGERS` (a worker process calls this once)."""
    safe = SafeLog(every_s)
    for name in LOGGERS:
        logging.getLogger(name).addFilter(safe)
    return safe
