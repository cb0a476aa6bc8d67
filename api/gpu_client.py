"""The worker's side of the ring protocol.

`GpuClient` names requests with small integer rids, sends `Submit` / `Cancel` through a
`Transport`, and routes what comes back (`Accepted`, `Rejected`, per-step `Token` / `Finish`
records, `Error`) to the request's `RequestStream`. It never blocks: a full ring parks outgoing
messages in order and retries them shortly, so a Cancel can never overtake its Submit or be lost.

Two transports implement the interface: the shared-memory ring pair (`ring_transport.py`, used by
the real worker) and an in-process fake GPU (`fake_gpu.py`, used by tests and `bench api`).

A GPU-process restart is handled by `RestartHold` (`restart_hold.py`), which `GpuClient` is:
fail what has streamed, hold and resubmit the rest.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import msgspec

from ringserve.api.errors import ApiError, error_type
from ringserve.api.restart_hold import RESTART_ERROR as RESTART_ERROR  # re-exported for callers and tests
from ringserve.api.restart_hold import RestartHold
from ringserve.shm.messages import (
    Accepted,
    Cancel,
    CancelReason,
    Error,
    Finish,
    Message,
    PromptLogprobs,
    Rejected,
    StepOutput,
    Submit,
    Token,
)
from ringserve.shm.ring import RecordTooLarge

log = logging.getLogger("ringserve.api.gpu_client")

_RETRY_S = 0.001  # how soon a refused send (full ring) is retried
RESTART_CODE = "gpu_restart"  # Error(rid=None) from a transport: the GPU process was replaced


class Transport(Protocol):
    """A duplex message channel to the GPU process."""

    def open(self, deliver: Callable[[Message], None]) -> None:
        """Start delivering incoming messages, on the event loop's thread, to `deliver`."""

    def send(self, msg: Submit | Cancel) -> bool:
        """Push one message; False when the channel is full right now (nothing was sent)."""

    def close(self) -> None:
        """Stop delivering and release the channel."""


@dataclass(frozen=True, slots=True)
class PromptScores:
    """A `PromptLogprobs` record, tagged with its stream's prompt index (a batched request)."""

    prompt: int
    record: PromptLogprobs


class Inbox:
    """Records waiting for a request's handler; the streams of a batched request share one."""

    __slots__ = ("_items", "_waiter")

    def __init__(self) -> None:
        self._items: list = []
        self._waiter: asyncio.Future | None = None

    def feed(self, item) -> None:
        self._items.append(item)
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def next_batch(self) -> list:
        """Everything that arrived since the last call; waits while there is nothing."""
        if not self._items:
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        items, self._items = self._items, []
        return items


class RequestStream:
    """One Submit's channel: its admission answer, then Token / Finish / PromptScores / Error
    records into its inbox. The streams of a batched request (one Submit per prompt) share an
    inbox; stream `prompt` renumbers its samples from `offset` (= prompt * n)."""

    __slots__ = (
        "rid",
        "admission",
        "submit",
        "streamed",
        "cancelled",
        "resubmits",
        "held_at",
        "inbox",
        "prompt",
        "offset",
    )

    def __init__(
        self, rid: int, loop: asyncio.AbstractEventLoop, inbox: Inbox | None = None, prompt: int = 0, offset: int = 0
    ) -> None:
        self.rid = rid  # changes when the request is resubmitted after a GPU-process restart
        self.admission: asyncio.Future = loop.create_future()
        self.submit: Submit | None = None  # as last sent, for a resubmission
        self.streamed = False  # output arrived: the request can no longer be resubmitted
        self.cancelled = False  # a Cancel was sent: never resubmit it
        self.resubmits = 0
        self.held_at = 0.0  # time.monotonic() when it was last held for resubmission
        self.inbox = inbox or Inbox()
        self.prompt = prompt
        self.offset = offset

    def feed(self, item) -> None:
        kind = type(item)
        if self.offset and (kind is Token or kind is Finish):
            item = msgspec.structs.replace(item, index=item.index + self.offset)
        elif kind is PromptLogprobs:
            item = PromptScores(self.prompt, item)
        self.inbox.feed(item)

    async def next_batch(self) -> list:
        """Everything that arrived (for every stream sharing the inbox) since the last call."""
        return await self.inbox.next_batch()

    def set_admission(self, msg: Accepted | Rejected | Error) -> None:
        if not self.admission.done():
            self.admission.set_result(msg)


class GpuClient(RestartHold):
    """Request bookkeeping for one worker; all methods run on the worker's event loop."""

    def __init__(
        self,
        transport: Transport,
        worker: int = 0,
        ready: Callable[[], bool] | None = None,
        hold_s: float = 30.0,
        down_reason: Callable[[], str | None] | None = None,
        first_rid: int = 1,
    ) -> None:
        """`ready()` says whether the GPU process is READY (the control block); held requests are
        resubmitted once it is, or failed after `hold_s`. None: always ready (a transport without
        restarts). `down_reason()` says how the last GPU process ended ("was killed by SIGKILL"),
        for the error a held request gets (None: unknown). Rids count from `first_rid`
        (`shm.messages.first_rid` of the worker's slot generation)."""
        self.transport = transport
        self.worker = worker
        self.ready = ready or (lambda: True)
        self.hold_s = hold_s
        self.down_reason = down_reason or (lambda: None)
        self._no_hold: tuple[str, str] | None = None  # (code, message) once draining
        self._streams: dict[int, RequestStream] = {}
        self._held: dict[int, RequestStream] = {}  # by rid: waiting for READY to be resubmitted
        self._poll: asyncio.TimerHandle | None = None
        self._restarting = False  # a restart was seen and the GPU process is not READY again yet
        self.resubmitted = 0  # requests resubmitted after a restart (for tests and stats)
        self._next_rid = first_rid
        self._pending: deque[Submit | Cancel] = deque()
        self._retry: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.transport.open(self.deliver)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None
        self.transport.close()
        self.fail_all("shutdown", "The server is shutting down.")

    @property
    def open_requests(self) -> int:
        return len(self._streams)

    # requests --------------------------------------------------------------------------------
    def open_stream(self, inbox: Inbox | None = None, prompt: int = 0, offset: int = 0) -> RequestStream:
        """Register a new Submit; its rid goes into the Submit the caller builds. The streams of a
        batched request share `inbox` (see `RequestStream`)."""
        rid = self._next_rid
        self._next_rid += 1
        stream = RequestStream(rid, self._loop or asyncio.get_running_loop(), inbox, prompt, offset)
        self._streams[rid] = stream
        return stream

    async def submit(self, stream: RequestStream, msg: Submit) -> Accepted:
        """Send `msg` and wait for admission; a refusal raises the ApiError to answer with."""
        if msg.rid != stream.rid:
            raise ValueError("Submit.rid must be the stream's rid")
        stream.submit = msg
        if self._restarting:
            # A restart is in progress: this Submit would land on rings the next GPU process
            # discards; it goes out with the held ones once that process is READY.
            self._hold(stream)
        else:
            self._send(msg)
        try:
            answer = await stream.admission
        except asyncio.CancelledError:
            # The client left while the request waited for admission: the GPU process may still
            # admit it, so cancel it now rather than spend prefill on nobody.
            self.cancel(stream.rid, CancelReason.DISCONNECT)
            self.release(stream)
            raise
        if isinstance(answer, Accepted):
            return answer
        self.release(stream)
        if isinstance(answer, Rejected):
            raise ApiError(answer.status, answer.message, code=answer.code, retry_after_s=answer.retry_after_s)
        kind = error_type(answer.code)
        message = answer.message if kind != "server_error" else f"The GPU process failed: {answer.message}"
        raise ApiError(503, message, code=answer.code, type_=kind, retry_after_s=1.0, extra={"tokens_streamed": 0})

    def cancel(self, rid: int, reason: CancelReason = CancelReason.CANCELLED, index: int | None = None) -> None:
        """End the request on the GPU, or only its sample `index` (the others keep running)."""
        stream = self._streams.get(rid)
        if stream is not None and index is None:
            stream.cancelled = True
        self._send(Cancel(rid=rid, reason=reason, index=index))

    def release(self, stream: RequestStream) -> None:
        """Forget a finished request; records that still arrive for it are dropped."""
        self._streams.pop(stream.rid, None)
        self._held.pop(stream.rid, None)

    def fail_all(self, code: str, message: str) -> None:
        """Every open request gets an error (GPU restart, shutdown)."""
        err = Error(code=code, message=message)
        self._held.clear()
        for stream in list(self._streams.values()):
            stream.set_admission(err)
            stream.feed(err)

    # incoming --------------------------------------------------------------------------------
    def deliver(self, msg: Message) -> None:
        """Route one incoming message (called by the transport on the event loop)."""
        streams = self._streams
        if type(msg) is StepOutput:
            for item in msg.prompt_logprobs:  # a chunk's prompt logprobs come before its tokens
                s = streams.get(item.rid)
                if s is not None:
                    s.streamed = True  # a resubmission would send them again
                    s.feed(item)
            for token in msg.tokens:
                s = streams.get(token.rid)
                if s is not None:
                    s.streamed = True
                    s.feed(token)
            for finish in msg.finishes:
                s = streams.get(finish.rid)
                if s is not None:
                    s.feed(finish)
        elif type(msg) is Accepted or type(msg) is Rejected:
            s = streams.get(msg.rid)
            if s is not None:
                s.set_admission(msg)
        elif type(msg) is Error:
            if msg.rid is None and msg.code == RESTART_CODE:
                self._on_restart()
            elif msg.rid is None:
                self.fail_all(msg.code, msg.message)
            else:
                s = streams.get(msg.rid)
                if s is not None:
                    s.set_admission(msg)
                    s.feed(msg)

    # outgoing --------------------------------------------------------------------------------
    def _send(self, msg: Submit | Cancel) -> None:
        if not self._pending and self._try_send(msg):
            return
        self._pending.append(msg)
        self._schedule_retry()

    def _try_send(self, msg: Submit | Cancel) -> bool:
        """Push `msg`; False when the channel is full. A message the channel can never take is
        refused to its request (413) rather than parked and retried forever."""
        try:
            return self.transport.send(msg)
        except RecordTooLarge as exc:
            stream = self._streams.get(msg.rid) if type(msg) is Submit else None
            if stream is not None:
                stream.set_admission(
                    Rejected(
                        rid=msg.rid,
                        status=413,
                        code="request_too_large",
                        message=f"The request is too large to pass to the GPU process ({exc}); send a shorter one.",
                    )
                )
            log.error(
                "worker %d: dropped a %s the request ring can never take: %s", self.worker, type(msg).__name__, exc
            )
            return True

    def _schedule_retry(self) -> None:
        if self._retry is None and self._loop is not None:
            self._retry = self._loop.call_later(_RETRY_S, self._flush)

    def _flush(self) -> None:
        self._retry = None
        pending = self._pending
        while pending and self._try_send(pending[0]):
            pending.popleft()
        if pending:
            self._schedule_retry()
