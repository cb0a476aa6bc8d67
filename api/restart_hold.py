"""What a worker does when the GPU process is replaced (`docs/design.md#failure-semantics`).

GPU-process restart (the transport delivers `Error(code=RESTART_CODE, rid=None)`): a request that
has streamed a token gets the `gpu_process_restart` error (its tokens cannot be continued); every
other open request is held and resubmitted, under a fresh rid, once the restarted GPU process is
READY ("retry before the first token"). That also covers a Submit pushed after the supervisor's
fence but before this worker noticed it, which the new GPU process discards when it adopts the
rings: it sits in the same held set. Submits made while held wait for READY rather than be pushed
onto rings that are about to be discarded. A held request waits at most `hold_s` (and never past
its deadline): if the GPU process is not back by then it gets the `gpu_process_restart` error,
quoting why the process failed. Once the worker drains (`stop_holding`) nothing is held any more:
no GPU process will be started for it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ringserve.shm.messages import Cancel, CancelReason, Error, Submit

if TYPE_CHECKING:
    from ringserve.api.gpu_client import RequestStream

log = logging.getLogger("ringserve.api.gpu_client")

RESTART_ERROR = "gpu_process_restart"  # the code and type a client sees for a restart
MAX_RESUBMITS = 1  # a request in flight through two crashes may be what crashes the GPU process
READY_POLL_S = 0.05  # how often held requests check whether the restarted GPU process is READY


class RestartHold:
    """The restart half of `GpuClient` (it is one): the state below is the client's own."""

    worker: int
    hold_s: float
    ready: Callable[[], bool]
    down_reason: Callable[[], str | None]
    resubmitted: int
    _streams: dict[int, RequestStream]
    _held: dict[int, RequestStream]  # by rid: waiting for READY to be resubmitted
    _no_hold: tuple[str, str] | None  # (code, message) once draining
    _poll: asyncio.TimerHandle | None
    _restarting: bool  # a restart was seen and the GPU process is not READY again yet
    _next_rid: int
    _pending: deque[Submit | Cancel]
    _loop: asyncio.AbstractEventLoop | None

    def _send(self, msg: Submit | Cancel) -> None:
        raise NotImplementedError  # GpuClient's

    def stop_holding(self, code: str, message: str) -> None:
        """The worker is draining: no GPU process will be started for it, so fail what is held
        now and what a restart would hold later, at once."""
        self._no_hold = (code, message)
        held, self._held = self._held, {}
        for stream in held.values():
            self._fail_held(stream, code, message)

    def _on_restart(self) -> None:
        """Fail what has streamed; hold the rest for resubmission once the GPU is READY."""
        failed = 0
        for stream in list(self._streams.values()):
            if stream.cancelled:
                continue  # ended for its client already; nothing to resubmit or tell
            if stream.streamed:
                failed += 1
                stream.feed(
                    Error(
                        code=RESTART_ERROR,
                        rid=stream.rid,
                        message=(
                            "The GPU process restarted after this request had streamed tokens; they "
                            "cannot be continued. Retry the request."
                        ),
                    )
                )
            elif stream.submit is not None and stream.resubmits >= MAX_RESUBMITS:
                failed += 1
                self._fail_held(
                    stream,
                    RESTART_ERROR,
                    "The GPU process restarted again while this request was in it; it is not "
                    "resubmitted a second time, in case it is what makes the process fail.",
                )
            elif stream.submit is not None:
                self._hold(stream)
        # Messages parked for the old rings are void: their Submits are all held (none streamed),
        # and their Cancels name rows the new process never had.
        self._pending.clear()
        self._restarting = True
        log.warning(
            "worker %d: GPU process restarted; %d streaming requests failed, %d held for resubmission once it is READY",
            self.worker,
            failed,
            len(self._held),
        )
        self._schedule_poll()

    def _hold(self, stream: RequestStream) -> None:
        if self._no_hold is not None:
            self._fail_held(stream, *self._no_hold)
            return
        stream.held_at = time.monotonic()
        self._held[stream.rid] = stream

    def _fail_held(self, stream: RequestStream, code: str, message: str) -> None:
        """A request that has streamed nothing ends with an error as its admission answer."""
        err = Error(code=code, rid=stream.rid, message=message)
        stream.set_admission(err)
        stream.feed(err)

    def _schedule_poll(self) -> None:
        if self._poll is None and self._loop is not None:
            self._poll = self._loop.call_later(READY_POLL_S, self._resubmit_held)

    def _expire_held(self) -> None:
        """Fail the held requests that waited `hold_s` for a GPU process that is not back."""
        now = time.monotonic()
        for rid, stream in list(self._held.items()):
            deadline = stream.submit.deadline_ts if stream.submit is not None else now
            if now - stream.held_at > self.hold_s or time.time() >= deadline:
                del self._held[rid]
                why = self.down_reason()
                self._fail_held(
                    stream,
                    RESTART_ERROR,
                    f"The GPU process failed{f' (it {why})' if why else ''} and was not back within "
                    f"{self.hold_s:g} s; this request was not run. Retry it.",
                )

    def _resubmit_held(self) -> None:
        self._poll = None
        if not self.ready():
            self._expire_held()
            self._schedule_poll()
            return
        self._restarting = False
        held, self._held = self._held, {}
        now = time.time()
        for old_rid, stream in held.items():
            submit = stream.submit
            if self._streams.get(old_rid) is not stream or submit is None:
                continue  # released meanwhile (a held stream always has its Submit)
            if now >= submit.deadline_ts:
                self._fail_held(
                    stream,
                    RESTART_ERROR,
                    "The GPU process restarted and the request's deadline passed before it could be resubmitted. "
                    "Retry it.",
                )
                continue
            # A fresh rid: if the old Submit did reach the new process after all (pushed after it
            # adopted the rings), its row is cancelled and any records it sends are dropped.
            rid = self._next_rid
            self._next_rid += 1
            del self._streams[old_rid]
            self._streams[rid] = stream
            stream.rid = rid
            stream.resubmits += 1
            stream.submit = submit = msgspec.structs.replace(submit, rid=rid)
            self.resubmitted += 1
            self._send(Cancel(rid=old_rid, reason=CancelReason.CANCELLED))
            self._send(submit)
        if held:
            log.info("worker %d: resubmitted %d requests to the restarted GPU process", self.worker, self.resubmitted)
