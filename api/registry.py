"""The requests open in this worker, by (tenant, request id): for DELETE and x-request-id uniqueness.

A client-chosen x-request-id names a request within its API key's tenant only: another tenant
choosing the same id, on this worker or another, neither gets a different id (which would tell it
the id is in use) nor hides the first request from its owner's DELETE. Generated ids carry the
worker index and 64 random bits each, so they are unique server-wide and one tenant's id says
nothing about another's (a counter would let it guess the ids around its own).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ringserve.api.connections import abort_connection
from ringserve.api.generation import Generation, LocalCancel
from ringserve.api.gpu_client import GpuClient
from ringserve.api.request_stream import RequestStream
from ringserve.shm.messages import MAX_REQUEST_ID_CHARS, CancelReason

_CLIENT_ID = re.compile(rf"^[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}$")


@dataclass(slots=True)
class OpenRequest:
    """A generation request open in this worker, from its submission to its release (one owner of
    its running state): what DELETE, the slow-reader watchdog and `last_words` see, its streams (one
    per prompt of a batch, `n` samples each) and, once its rows are submitted, its output."""

    request_id: str
    tenant: str
    streams: list[RequestStream]  # every stream feeds the first one's inbox
    transport: Any  # the client connection's asyncio transport (None once it closed)
    client: GpuClient
    gen: Generation | None = None  # its output state, set once its rows are submitted
    write_since: float = 0.0  # loop.time() when a still-blocked write started; 0: not writing
    ended_by: CancelReason | None = None  # why it ended early (DELETE, a slow reader, a disconnect); set once
    # Once its SSE has begun: (code, message) -> the bytes that end the stream with that error
    # (an error event and [DONE], framed as the response is); see `last_words`.
    farewell: Callable[[str, str], bytes] | None = None

    def end(self, reason: CancelReason) -> bool:
        """End the request from the worker's side (`DELETE` or `SLOW_READER`); the first reason
        given is the one it keeps. True if this call ended it: a request that is already ending
        (while its handler settles) is no longer open, so a second DELETE is a 404."""
        first = self.ended_by is None
        if first:
            self.ended_by = reason
        if reason is CancelReason.SLOW_READER:
            # Closing the connection ends the handler (cancelled, or its blocked write fails).
            if self.transport is not None:
                abort_connection(self.transport)
        elif first:
            # Stop the work on the GPU now: the handler may be blocked writing to a client that
            # reads nothing.
            self.cancel_running()
            self.streams[0].feed(LocalCancel(reason))
        return first

    async def next_batch(self) -> list:
        return await self.streams[0].next_batch()  # every stream feeds the one inbox

    def running(self) -> list[RequestStream]:
        """The streams with a sample the GPU has not finished."""
        if self.gen is None:
            return []
        n, samples = self.gen.n, self.gen.samples
        return [s for p, s in enumerate(self.streams) if not all(x.gpu_done for x in samples[p * n : (p + 1) * n])]

    def cancel_running(self) -> None:
        """Cancel every stream the GPU still runs (once each: a DELETE may have already)."""
        reason = self.cancel_reason()
        for stream in self.running():
            if not stream.cancelled:
                self.client.cancel(stream.rid, reason)

    def cancel_sample(self, gen: Generation, index: int) -> None:
        """A stop string ended choice `index` of `gen` (this request's output): stop its row."""
        self.client.cancel(self.streams[index // gen.n].rid, CancelReason.STOP, index=index % gen.n)

    def cancel_reason(self) -> CancelReason:
        """Why the rows still running are cancelled: the reason the request ended early, else a
        stop string ended every sample, else its client went away."""
        if self.ended_by is CancelReason.DELETE:
            return CancelReason.CANCELLED  # NOTE: the GPU process ends it alike; the wire says cancelled
        if self.ended_by is not None:
            return self.ended_by
        return CancelReason.STOP if self.gen is not None and self.gen.unfinished == 0 else CancelReason.DISCONNECT


class Registry:
    """This worker's open requests, keyed by (tenant, request id)."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self._open: dict[tuple[str, str], OpenRequest] = {}

    def new_id(self, client_id: str | None, tenant: str) -> str:
        """The client's x-request-id when it is well-formed and not open for this tenant here,
        else a fresh one."""
        if client_id and _CLIENT_ID.match(client_id) and (tenant, client_id) not in self._open:
            return client_id
        return f"cmpl-{self.worker}-{secrets.token_hex(8)}"

    def add(self, entry: OpenRequest) -> None:
        self._open[(entry.tenant, entry.request_id)] = entry

    def remove(self, entry: OpenRequest) -> None:
        if self._open.get((entry.tenant, entry.request_id)) is entry:
            del self._open[(entry.tenant, entry.request_id)]

    def get(self, request_id: str, tenant: str) -> OpenRequest | None:
        return self._open.get((tenant, request_id))

    def __len__(self) -> int:
        return len(self._open)

    def values(self):
        return self._open.values()
