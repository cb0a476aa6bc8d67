"""The worker's side of the ring protocol.

`GpuClient` names requests with small integer rids, sends `Submit` / `Cancel` through a
`Transport`, and routes what comes back (`Accepted`, `Rejected`, per-step `Token` / `Finish`
records, `Error`) to the request's `RequestStream`. It never blocks: a full ring parks outgoing
messages in order and retries them shortly, so a Cancel can never overtake its Submit or be lost.

Two transports implement the interface: the shared-memory ring pair (`ring_transport.py`, used by
the real worker) and an in-process fake GPU (`fake_gpu.py`, used by tests and `bench api`).

A GPU-process restart is handled by its `RestartHold` (`restart_hold.py`, `client.restart_hold`):
fail what is quarantined or has streamed, hold and resubmit the rest; and refuse a resend of a
quarantined request. The request's channel back is `RequestStream` (`request_stream.py`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Mapping
from typing import Protocol

import msgspec

from ringserve.api.errors import ApiError, error_status, error_type
from ringserve.api.request_stream import Inbox, RequestStream
from ringserve.api.restart_hold import QUARANTINE_ERROR, RESTART_ERROR, RestartHold
from ringserve.config import DEFAULTS
from ringserve.shm.messages import (
    Accepted,
    Cancel,
    CancelReason,
    Error,
    LoadLora,
    Message,
    Rejected,
    StepOutput,
    Submit,
    ToGpu,
    UnloadLora,
)
from ringserve.shm.ring import RecordTooLarge

log = logging.getLogger("ringserve.api.gpu_client")

_RETRY_S = 0.001  # how soon a refused send (full ring) is retried
RESTART_CODE = "gpu_restart"  # Error(rid=None) from a transport: the GPU process was replaced


class Transport(Protocol):
    """A duplex message channel to the GPU process."""

    def open(self, deliver: Callable[[Message], None]) -> None:
        """Start delivering incoming messages, on the event loop's thread, to `deliver`."""

    def send(self, msg: ToGpu) -> bool:
        """Push one message; False when the channel is full right now (nothing was sent)."""

    def close(self) -> None:
        """Stop delivering and release the channel."""


class GpuClient:
    """Request bookkeeping for one worker; all methods run on the worker's event loop."""

    def __init__(
        self,
        transport: Transport,
        worker: int = 0,
        ready: Callable[[], bool] | None = None,
        hold_s: float = DEFAULTS.restart_hold_s,
        down_reason: Callable[[], str | None] | None = None,
        first_rid: int = 1,
        quarantined: Callable[[], Mapping[int, float]] | None = None,
        fingerprint_key: bytes = b"",
        priced: Callable[[str, float], None] | None = None,
    ) -> None:
        """`ready()` says whether the GPU process is READY (the control block); held requests are
        resubmitted once it is, or failed after `hold_s`. None: always ready (a transport without
        restarts). `down_reason()` says how the last GPU process ended ("was killed by SIGKILL"),
        for the error a held request gets (None: unknown). Rids count from `first_rid`
        (`shm.messages.first_rid` of the worker's slot generation). `quarantined()` is the
        supervisor's quarantine ({fingerprint: until}, None: nothing is), fingerprints keyed
        with `fingerprint_key`. `priced(tenant, est_ms)` hears the price of every admitted or
        429-refused request (the worker's refusals at once read it: `api/refusals.py`)."""
        self.transport = transport
        self.worker = worker
        self.priced = priced or (lambda tenant, est_ms: None)
        self.restart_hold = RestartHold(
            self._resubmit,
            worker=worker,
            ready=ready,
            hold_s=hold_s,
            down_reason=down_reason,
            quarantined=quarantined,
            fingerprint_key=fingerprint_key,
        )
        self._streams: dict[int, RequestStream] = {}
        self.resubmitted = 0  # requests resubmitted after a restart (for tests and stats)
        self._next_rid = first_rid
        self._pending: deque[ToGpu] = deque()
        self._retry: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changes: set[int] = set()  # rids of adapter changes waiting for their answer

    # lifecycle -------------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self.restart_hold.start(self._loop)
        self.transport.open(self.deliver)

    def close(self) -> None:
        if self._retry is not None:
            self._retry.cancel()
        self.restart_hold.close()
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
        stream.submit = msg = self.restart_hold.fingerprinted(msg)
        if self.restart_hold.restarting:
            # A restart is in progress: this Submit would land on rings the next GPU process
            # discards; it goes out with the held ones once that process is READY.
            self.restart_hold.hold(stream)
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
            self.priced(msg.tenant, answer.est_gpu_ms)
            return answer
        self.release(stream)
        if isinstance(answer, Rejected):
            if answer.status == 429:
                self.priced(msg.tenant, answer.est_gpu_ms)
            raise ApiError(answer.status, answer.message, code=answer.code, retry_after_s=answer.retry_after_s)
        kind = error_type(answer.code)
        message = answer.message if kind != "server_error" else f"The GPU process failed: {answer.message}"
        quarantined = answer.code == QUARANTINE_ERROR
        raise ApiError(
            error_status(answer.code),
            message,
            code=answer.code,
            type_=kind,
            retry_after_s=self.restart_hold.quarantine_left(msg.fingerprint) if quarantined else 1.0,
            extra={"tokens_streamed": 0},
        )

    async def change_loras(self, make: Callable[[int], LoadLora | UnloadLora]) -> None:
        """Send the adapter change `make(rid)` builds and wait for the GPU process's answer; a
        refusal raises the ApiError to answer with. Never held over a restart: the caller retries."""
        if self.restart_hold.restarting:
            raise ApiError(503, "The GPU process is restarting; retry.", code="gpu_restarting", retry_after_s=1.0)
        stream = self.open_stream()
        self._changes.add(stream.rid)
        self._send(make(stream.rid))
        try:
            answer = await stream.admission
        finally:
            self._changes.discard(stream.rid)
            self.release(stream)
        if isinstance(answer, Rejected):
            raise ApiError(answer.status, answer.message, code=answer.code)
        if not isinstance(answer, Accepted):
            raise ApiError(503, answer.message, code=answer.code, type_=error_type(answer.code), retry_after_s=1.0)

    def cancel(self, rid: int, reason: CancelReason = CancelReason.CANCELLED, index: int | None = None) -> None:
        """End the request on the GPU, or only its sample `index` (the others keep running)."""
        stream = self._streams.get(rid)
        if stream is not None and index is None:
            stream.cancelled = True
        self._send(Cancel(rid=rid, reason=reason, index=index))

    def release(self, stream: RequestStream) -> None:
        """Forget a finished request; records that still arrive for it are dropped."""
        self._streams.pop(stream.rid, None)
        self.restart_hold.release(stream.rid)

    def fail_all(self, code: str, message: str) -> None:
        """Every open request gets an error (GPU restart, shutdown)."""
        err = Error(code=code, message=message)
        self.restart_hold.clear()
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
            for pooled in msg.pooled:  # and so do its pooled hidden states
                s = streams.get(pooled.rid)
                if s is not None:
                    s.streamed = True
                    s.feed(pooled)
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
            if s is None:
                pass
            elif type(msg) is Rejected and s.admission.done():
                # A resubmission refused by the restarted process: the request was admitted
                # before, so the refusal is its end, not its admission answer.
                s.feed(
                    Error(
                        code=RESTART_ERROR,
                        rid=msg.rid,
                        message=f"The GPU process restarted, and resubmitting this request to it was refused "
                        f"({msg.message}). Retry it.",
                    )
                )
            else:
                s.set_admission(msg)
        elif type(msg) is Error:
            if msg.rid is None and msg.code == RESTART_CODE:
                for rid in self._changes:  # adapter changes are not resent: their callers retry
                    streams[rid].set_admission(
                        Error(code=RESTART_ERROR, rid=rid, message="The GPU process restarted before answering; retry.")
                    )
                self.restart_hold.on_restart([s for s in streams.values() if s.rid not in self._changes])
                # Messages parked for the old rings are void: their Submits are all held (none
                # streamed), and their Cancels name rows the new process never had.
                self._pending.clear()
            elif msg.rid is None:
                self.fail_all(msg.code, msg.message)
            else:
                s = streams.get(msg.rid)
                if s is not None:
                    s.set_admission(msg)
                    s.feed(msg)

    def _resubmit(self, held: list[RequestStream]) -> None:
        """Send the held streams to the restarted GPU process, each under a fresh rid."""
        for stream in held:
            old_rid, submit = stream.rid, stream.submit
            if self._streams.get(old_rid) is not stream or submit is None:
                continue  # released meanwhile (a held stream always has its Submit)
            # A fresh rid: if the old Submit did reach the new process after all (pushed after it
            # adopted the rings), its row is cancelled and any records it sends are dropped.
            rid = self._next_rid
            self._next_rid += 1
            del self._streams[old_rid]
            self._streams[rid] = stream
            stream.rid = rid
            stream.resubmits += 1
            stream.submit = msgspec.structs.replace(submit, rid=rid)
            self.resubmitted += 1
            self._send(Cancel(rid=old_rid, reason=CancelReason.CANCELLED))
            self._send(stream.submit)
        log.info("worker %d: resubmitted %d requests to the restarted GPU process", self.worker, self.resubmitted)

    # outgoing --------------------------------------------------------------------------------
    def _send(self, msg: ToGpu) -> None:
        if not self._pending and self._try_send(msg):
            return
        self._pending.append(msg)
        self._schedule_retry()

    def _try_send(self, msg: ToGpu) -> bool:
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
