"""Every state of a client connection has a time limit, and the open connections stay under the
worker's open-file limit (docs/design.md#limits-and-timeouts).

The worker serves its app through aiohttp's runner but listens itself (`ConnectionGuard.listen`),
so it sees each connection from the moment it is accepted. A connection is in one of four states:

    waiting   accepted, no complete request head yet     closed after header_timeout_s
    busy      a request is being handled                 its body must arrive within
                                                         body_timeout_s; the answer follows the
                                                         request's own rules (deadline, slow reader)
    idle      its response is written, bytes unsent      aborted after slow_reader_s without
              (the client reads nothing)                 progress (the unsent bytes not going down)
    idle      nothing unsent: keep-alive, or a next      closed after keepalive_timeout_s
              request head that never completes

A sweep every `SWEEP_S` closes the connections over their state's limit. A worker at
`max_connections` (derived from RLIMIT_NOFILE unless set) makes room for a new connection by
closing its oldest waiting or idle one (not one still delivering an answer); if there is none it
refuses the new one. Both
are logged, so a full worker is never silent. Errors aiohttp answers itself (a malformed request
line or header) get the OpenAI error object like every other error.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import resource
import socket
import struct
import termios
from collections import OrderedDict
from dataclasses import dataclass, field

from aiohttp import web

from ringserve.api.errors import ApiError
from ringserve.config import Config

log = logging.getLogger("ringserve.api.connections")

SWEEP_S = 0.25  # how often time limits are checked: a limit is enforced within this much
FD_HEADROOM = 64  # open files a worker keeps for itself beyond the ones open at start
LOG_EVERY_S = 5.0  # at most one refusal / eviction log line per this many seconds
LINGER_S = 2.0  # how long an unread request body is drained after an error answer
MAKE_ROOM_TRIES = 16  # oldest idle connections looked at for one to close at the limit
_OUTQ = struct.Struct("i")


def raise_open_file_limit() -> tuple[int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard limit (each connection is a file); (old, new)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = soft
    if soft != resource.RLIM_INFINITY and target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            return soft, target
        except (OSError, ValueError):
            pass
    return soft, soft


def connection_budget(configured: int) -> int:
    """How many client connections this process can hold: `configured` (0: no own cap) within
    the open-file limit, less the files already open and `FD_HEADROOM`."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    try:
        in_use = len(os.listdir("/proc/self/fd"))
    except OSError:
        in_use = 32
    room = max(8, soft - in_use - FD_HEADROOM) if soft != resource.RLIM_INFINITY else 1 << 20
    return min(room, configured) if configured > 0 else room


@dataclass(slots=True)
class _Conn:
    answered: bool  # False: waiting for its first request head; True: idle after a response
    since: float  # loop.time() the state began, or the client last took bytes of the answer
    unsent: int = -1  # bytes of the answer the client had not taken at the last look (-1: none)


@dataclass(slots=True)
class _RateLog:
    """A warning at most every LOG_EVERY_S, with how many events it stands for."""

    what: str
    count: int = 0
    last: float = field(default=-LOG_EVERY_S)

    def event(self, now: float, detail: str) -> None:
        self.count += 1
        if now - self.last >= LOG_EVERY_S:
            log.warning("%s (%d since the last such line): %s", self.what, self.count, detail)
            self.count = 0
            self.last = now


class ConnectionGuard:
    """Accounts for this worker's client connections; see the module docstring."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.max_connections = 0  # set by listen()
        # NOTE: connections not handling a request, oldest state first: the one to close for room
        # is the first (O(1) at every accept, even under a flood), and the sweep never walks the
        # busy ones (thousands of streams).
        self._idle: OrderedDict[web.RequestHandler, _Conn] = OrderedDict()
        self._busy: set[web.RequestHandler] = set()
        self._refused = _RateLog(
            "refused new connections: every connection is handling a request or delivering an answer"
        )
        self._evicted = _RateLog("closed waiting or idle connections to make room for new ones")
        self._timed_out = 0  # connections closed by a time limit, for tests and logs

    @property
    def open_connections(self) -> int:
        return len(self._idle) + len(self._busy)

    @property
    def timed_out(self) -> int:
        return self._timed_out

    # serving ---------------------------------------------------------------------------------
    async def listen(self, server: web.Server, sock: socket.socket) -> asyncio.AbstractServer:
        """Accept on `sock` (already bound) with the configured backlog; every connection is
        handled by aiohttp's `server` through an `ApiRequestHandler` and accounted here."""
        self.max_connections = connection_budget(self.config.max_connections)
        loop = asyncio.get_running_loop()
        # NOTE: aiohttp's own idle timer would close a connection with unsent bytes gracefully
        # (the kernel keeps them); this guard enforces keep-alive and slow readers itself.
        kwargs = dict(
            loop=loop,
            access_log=None,
            lingering_time=LINGER_S,
            keepalive_timeout=self.config.keepalive_timeout_s + self.config.slow_reader_s + 60,
        )
        return await loop.create_server(
            lambda: ApiRequestHandler(server, self, **kwargs), sock=sock, backlog=self.config.listen_backlog
        )

    def opened(self, handler: web.RequestHandler) -> None:
        now = asyncio.get_running_loop().time()
        if self.open_connections >= self.max_connections and not self._make_room(now):
            self._refused.event(
                now,
                f"{self.open_connections} open, the limit is {self.max_connections} "
                f"(RLIMIT_NOFILE {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}); "
                "raise the open-file limit or add workers",
            )
            if handler.transport is not None:
                abort_connection(handler.transport)
            return
        self._idle[handler] = _Conn(False, now)

    def closed(self, handler: web.RequestHandler) -> None:
        self._idle.pop(handler, None)
        self._busy.discard(handler)

    def _make_room(self, now: float) -> bool:
        """Close the connection that has waited or idled longest, passing over (a few) that are
        still delivering an answer; False if there is none to close."""
        for handler, conn in itertools.islice(self._idle.items(), MAKE_ROOM_TRIES):
            if conn.answered and _unsent_bytes(handler):
                continue
            del self._idle[handler]
            _abort(handler)
            self._evicted.event(now, f"{self.max_connections} connections is this worker's limit")
            return True
        return False

    # request lifecycle -----------------------------------------------------------------------
    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        """Marks the connection busy while its request is handled."""
        protocol = request.protocol
        tracked = self._idle.pop(protocol, None) is not None  # not tracked: a test server's
        if tracked:
            self._busy.add(protocol)
        try:
            return await handler(request)
        finally:
            if tracked and protocol in self._busy:  # (not if it closed meanwhile)
                self._busy.discard(protocol)
                self._idle[protocol] = _Conn(True, asyncio.get_running_loop().time())

    @web.middleware
    async def read_body(self, request: web.Request, handler) -> web.StreamResponse:
        """Reads the request body within body_timeout_s (handlers then get it from aiohttp's
        cache). It runs after authentication: no body is read, nor inflated, for a request
        without a valid key. A body that does not decode (bad gzip) is a 400, not a 500."""
        if request.body_exists:
            limit = self.config.body_timeout_s
            try:
                async with asyncio.timeout(limit):
                    await request.read()
            except TimeoutError:
                raise ApiError(
                    408,
                    f"The request body did not arrive within {limit:g} s (body_timeout_s); send it at once.",
                    code="body_timeout",
                    close_connection=True,
                ) from None
            except web.RequestPayloadError:
                encoding = request.headers.get("Content-Encoding", "identity")[:32]
                raise ApiError(
                    400,
                    f"The request body could not be read: it does not decode as its Content-Encoding "
                    f"({encoding!r}) says, or its chunked framing is broken. Send it uncompressed, or "
                    "gzip or deflate compressed whole.",
                    code="invalid_body_encoding",
                    close_connection=True,
                ) from None
        return await handler(request)

    # time limits -----------------------------------------------------------------------------
    async def sweep_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(SWEEP_S)
            self.sweep(loop.time())

    def sweep(self, now: float) -> None:
        """Close every connection over its state's time limit (module docstring)."""
        cfg = self.config
        expired, reading = [], []
        for handler, conn in self._idle.items():
            age = now - conn.since
            if not conn.answered:
                if age > cfg.header_timeout_s:
                    expired.append((handler, False))
            elif age > min(cfg.keepalive_timeout_s, cfg.slow_reader_s / 2):
                # Looked at from half the slow-reader limit on, so a client that is taking the
                # answer, however slowly, is seen to make progress before the limit comes.
                unsent = _unsent_bytes(handler)
                if unsent and 0 <= conn.unsent and unsent < conn.unsent:
                    reading.append(handler)  # a slow but reading client: its clock restarts
                elif unsent and age > cfg.slow_reader_s:
                    expired.append((handler, True))
                elif not unsent and age > cfg.keepalive_timeout_s:
                    expired.append((handler, False))
                conn.unsent = unsent
        for handler in reading:
            self._idle[handler].since = now
            self._idle.move_to_end(handler)
        for handler, abort in expired:
            del self._idle[handler]
            self._timed_out += 1
            if abort:
                _abort(handler)
            elif handler.transport is not None:
                handler.transport.close()


def _abort(handler: web.RequestHandler) -> None:
    if handler.transport is not None:
        abort_connection(handler.transport)


_LINGER_RESET = struct.pack("ii", 1, 0)


def abort_connection(transport) -> None:
    """Drop a connection with a reset. A plain close (or asyncio's `abort`) leaves the bytes the
    client never read queued in the kernel behind a FIN, possibly for minutes; SO_LINGER 0 makes
    the close send RST and free them."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
        except OSError:
            pass
    transport.abort()


def _unsent_bytes(handler: web.RequestHandler) -> int:
    """Bytes written to the connection that the client has not taken: the transport's buffer plus
    the kernel's send queue (SIOCOUTQ)."""
    transport = handler.transport
    if transport is None:
        return 0
    pending = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is not None:
        try:
            pending += _OUTQ.unpack(fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]
        except OSError:
            pass
    return pending


class ApiRequestHandler(web.RequestHandler):
    """aiohttp's per-connection protocol, reporting to the guard and answering the errors aiohttp
    raises itself (malformed requests, unhandled exceptions) with the OpenAI error object."""

    __slots__ = ("_guard",)

    def __init__(self, manager: web.Server, guard: ConnectionGuard, **kwargs) -> None:
        super().__init__(manager, **kwargs)
        self._guard = guard

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._guard.opened(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self._guard.closed(self)
        super().connection_lost(exc)

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        plain = super().handle_error(request, status, exc, message)  # logs; raises if too late
        if status >= 500:
            text, code = "The server failed while handling the request; retry it.", "internal_error"
        else:
            text = (message or plain.reason or "Bad request").splitlines()[0].rstrip(":")
            text, code = f"Malformed HTTP request: {text}.", "invalid_http_request"
        return ApiError(status, text, code=code, close_connection=True).response()
