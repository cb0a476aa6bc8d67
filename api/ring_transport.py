"""The worker's `Transport` over its shared-memory ring pair and doorbells.

Outgoing `Submit` / `Cancel` are msgpack records pushed onto the worker's request ring, then the
GPU process's input doorbell is rung. Incoming records arrive on the output ring; the worker's
output doorbell (an eventfd) is registered with the event loop, so the loop wakes exactly when the
GPU process has pushed a step's records and never polls.

When the ring generation changes (the supervisor fenced the rings after the GPU process died), one
`Error(code=RESTART_CODE, rid=None)` is delivered: `GpuClient` fails the requests that streamed
tokens and resubmits the others once the restarted GPU process is READY.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from ringserve.api.gpu_client import RESTART_CODE
from ringserve.shm.doorbell import Doorbell
from ringserve.shm.messages import Error, Message, ToGpu, decode, encode
from ringserve.shm.ring import Ring

GENERATION_CHECK_S = 0.25
MAX_RECORDS_PER_WAKE = 16  # StepOutputs handled per event-loop callback (one per GPU step)


class RingTransport:
    """Transport for worker slot `i` of a shared-memory instance."""

    def __init__(self, requests: Ring, outputs: Ring, input_bell: Doorbell, output_bell: Doorbell) -> None:
        self.requests = requests  # this worker -> GPU process (we produce)
        self.outputs = outputs  # GPU process -> this worker (we consume)
        self.input_bell = input_bell
        self.output_bell = output_bell
        self._deliver: Callable[[Message], None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._generation = outputs.generation
        self._timer: asyncio.TimerHandle | None = None

    @classmethod
    def for_slot(cls, instance, slot: int) -> RingTransport:
        """From an attached `shm.instance.ShmInstance` (with its doorbells) and a worker slot."""
        if instance.input_bell is None or instance.output_bells is None:
            raise ValueError("the shm instance was attached without its doorbells")
        requests, outputs = instance.worker_rings(slot)  # output of a dead predecessor is dropped
        return cls(requests, outputs, instance.input_bell, instance.output_bells[slot])

    # Transport -------------------------------------------------------------------------------
    def open(self, deliver: Callable[[Message], None]) -> None:
        self._deliver = deliver
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self.output_bell.fileno(), self._on_bell)
        self._on_bell()  # records pushed before we listened
        self._watch()

    def send(self, msg: ToGpu) -> bool:
        if not self.requests.try_push(encode(msg)):
            return False
        self.input_bell.ring()
        return True

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._loop is not None and self.output_bell.fileno() >= 0:
            self._loop.remove_reader(self.output_bell.fileno())
        self._deliver = None

    def _watch(self) -> None:
        """Check the generation even while the GPU process sends us nothing: a restarted one may
        never ring this worker's bell, and open streams must not wait forever."""
        if self._deliver is None or self._loop is None:
            return
        self._check_generation(self._deliver)
        self._timer = self._loop.call_later(GENERATION_CHECK_S, self._watch)

    # incoming --------------------------------------------------------------------------------
    def _on_bell(self) -> None:
        # NOTE: drain first, then pop until empty: a ring after the drain stays in the counter and
        # wakes us again, so no record is left behind (see shm/doorbell.py).
        self.output_bell.drain()
        self._take()

    def _take(self) -> None:
        deliver = self._deliver
        if deliver is None:
            return
        self._check_generation(deliver)
        outputs = self.outputs
        # A bounded batch per callback: after a backlog (the worker fell behind) the event loop
        # still gets to write to clients and accept requests between batches.
        views = outputs.pop_views(MAX_RECORDS_PER_WAKE)
        try:
            # decode() copies everything out of the view, so the space can be released after.
            messages = [decode(v) for v in views]
        finally:
            for v in views:
                v.release()
            outputs.release()
        outputs.consumer_heartbeat()
        self.requests.producer_heartbeat()
        for msg in messages:
            deliver(msg)
        if len(views) == MAX_RECORDS_PER_WAKE and not outputs.is_empty() and self._loop is not None:
            self._loop.call_soon(self._take)  # the bell was drained: come back for the rest

    def _check_generation(self, deliver: Callable[[Message], None]) -> None:
        generation = self.outputs.generation
        if generation != self._generation:
            self._generation = generation
            deliver(Error(code=RESTART_CODE, message="The GPU process restarted."))
