"""What a worker does when the GPU process is replaced (`docs/design.md#failure-semantics`).

GPU-process restart (the transport delivers `Error(code=RESTART_CODE, rid=None)`): a request the
supervisor has quarantined (it was in the process's running step at two deaths,
`ringserve/suspects.py`) gets the `request_quarantined` error and is never resubmitted; a request
that has streamed a token gets the `gpu_process_restart` error (its tokens cannot be continued);
every other open request is held and resubmitted, under a fresh rid, once the restarted GPU
process is READY ("retry before the first token"), at most `MAX_RESUBMITS` times (a death outside
any step names no suspect, so this bounds what an unnamed one can cost). A Submit of a request
still quarantined (a client's resend: the same fingerprint) is refused with 422 before it reaches
the ring. Held requests also cover a Submit pushed after the supervisor's
fence but before this worker noticed it, which the new GPU process discards when it adopts the
rings: it sits in the same held set. Submits made while held wait for READY rather than be pushed
onto rings that are about to be discarded. A held request waits at most `hold_s` (and never past
its deadline): if the GPU process is not back by then it gets the `gpu_process_restart` error,
quoting why the process failed. Once the worker drains (`stop_holding`) nothing is held any more:
no GPU process will be started for it.

`RestartHold` is a part of `GpuClient` (`client.restart_hold`): it decides who is failed, held and
resubmitted and when; the client owns the streams and the rids, and sends the resubmissions.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

import msgspec

from ringserve.api.errors import ApiError
from ringserve.api.request_stream import RequestStream
from ringserve.shm.messages import Error, Submit, fingerprint

log = logging.getLogger("ringserve.api.gpu_client")

RESTART_ERROR = "gpu_process_restart"  # the code and type a client sees for a restart
QUARANTINE_ERROR = "request_quarantined"  # ... for a request not run again (422 before any SSE)
MAX_RESUBMITS = 3  # a request held through more deaths than this, none of them blamed on it, fails
READY_POLL_S = 0.05  # how often held requests check whether the restarted GPU process is READY


class RestartHold:
    """The held requests of one worker across GPU-process restarts, and the quarantine check."""

    def __init__(
        self,
        resubmit: Callable[[list[RequestStream]], None],
        *,
        worker: int,
        ready: Callable[[], bool] | None,
        hold_s: float,
        down_reason: Callable[[], str | None] | None,
        quarantined: Callable[[], Mapping[int, float]] | None,
        fingerprint_key: bytes,
    ) -> None:
        """`resubmit(streams)` sends the held streams again once the GPU process is READY (the
        client's: fresh rids, a Cancel of each old one); the rest as `GpuClient` documents them."""
        self.resubmit = resubmit
        self.worker = worker
        self.ready = ready or (lambda: True)
        self.hold_s = hold_s
        self.down_reason = down_reason or (lambda: None)
        self.quarantined = quarantined or dict
        self.fingerprint_key = fingerprint_key
        self.restarting = False  # a restart was seen and the GPU process is not READY again yet
        self._held: dict[int, RequestStream] = {}  # by rid: waiting for READY to be resubmitted
        self._no_hold: tuple[str, str] | None = None  # (code, message) once draining
        self._poll: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def close(self) -> None:
        if self._poll is not None:
            self._poll.cancel()
            self._poll = None

    def stop_holding(self, code: str, message: str) -> None:
        """The worker is draining: no GPU process will be started for it, so fail what is held
        now and what a restart would hold later, at once."""
        self._no_hold = (code, message)
        held, self._held = self._held, {}
        for stream in held.values():
            self._fail_held(stream, code, message)

    def quarantine_left(self, fp: int) -> float:
        """Seconds the request of fingerprint `fp` stays quarantined (<= 0: it is not)."""
        return self.quarantined().get(fp, 0.0) - time.time()

    def fingerprinted(self, msg: Submit) -> Submit:
        """`msg` with its fingerprint; ApiError 422 if that request is quarantined (a resend)."""
        msg = msgspec.structs.replace(msg, fingerprint=fingerprint(msg, self.fingerprint_key))
        left = self.quarantine_left(msg.fingerprint)
        if left > 0:
            raise ApiError(
                422,
                "This request (the same key, prompt and parameters) was in the GPU process's running step at two "
                f"of its failures, so it is not run again for another {left:.0f} s, in case it is what makes the "
                "process fail. Change the request, or retry it after the Retry-After.",
                code=QUARANTINE_ERROR,
                type_=QUARANTINE_ERROR,
                retry_after_s=left,
                extra={"tokens_streamed": 0},
            )
        return msg

    def on_restart(self, streams: Iterable[RequestStream]) -> None:
        """Fail what is quarantined or has streamed of the open `streams`; hold the rest for
        resubmission once the GPU is READY."""
        failed = 0
        quarantined, now = self.quarantined(), time.time()
        for stream in streams:
            if stream.cancelled:
                continue  # ended for its client already; nothing to resubmit or tell
            until = quarantined.get(stream.submit.fingerprint, 0.0) if stream.submit is not None else 0.0
            if until > now:
                failed += 1
                self._fail_held(
                    stream,
                    QUARANTINE_ERROR,
                    "This request was in the GPU process's running step at two of its failures; it is not run "
                    "again, in case it is what makes the process fail, and the same request (same key, prompt "
                    f"and parameters) is refused for {until - now:.0f} s. Change it, or report it.",
                )
            elif stream.streamed:
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
                    f"The GPU process restarted {stream.resubmits + 1} times while this request waited; it is not "
                    "resubmitted again. Retry it.",
                )
            elif stream.submit is not None:
                self.hold(stream)
        self.restarting = True
        log.warning(
            "worker %d: GPU process restarted; %d streaming requests failed, %d held for resubmission once it is READY",
            self.worker,
            failed,
            len(self._held),
        )
        self._schedule_poll()

    def hold(self, stream: RequestStream) -> None:
        """Keep `stream` (its Submit) for the GPU process that comes back, or fail it if none will."""
        if self._no_hold is not None:
            self._fail_held(stream, *self._no_hold)
            return
        stream.held_at = time.monotonic()
        self._held[stream.rid] = stream

    def release(self, rid: int) -> None:
        """The request ended: nothing to resubmit."""
        self._held.pop(rid, None)

    def clear(self) -> None:
        """Every open request was failed (shutdown, a GPU error for all)."""
        self._held.clear()

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
        self.restarting = False
        held, self._held = self._held, {}
        now = time.time()
        again = []
        for stream in held.values():
            if stream.submit is not None and now >= stream.submit.deadline_ts:
                self._fail_held(
                    stream,
                    RESTART_ERROR,
                    "The GPU process restarted and the request's deadline passed before it could be resubmitted. "
                    "Retry it.",
                )
            else:
                again.append(stream)
        if again:
            self.resubmit(again)
