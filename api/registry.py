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
from ringserve.api.generation import LocalCancel
from ringserve.api.request_stream import RequestStream
from ringserve.shm.messages import MAX_REQUEST_ID_CHARS, CancelReason

_CLIENT_ID = re.compile(rf"^[A-Za-z0-9._:\-]{{1,{MAX_REQUEST_ID_CHARS}}}$")


@dataclass(slots=True)
class OpenRequest:
    """An open request as DELETE and the slow-reader watchdog see it."""

    request_id: str
    tenant: str
    stream: RequestStream
    transport: Any  # the client connection's asyncio transport (None once it closed)
    write_since: float = 0.0  # loop.time() when a still-blocked write started; 0: not writing
    ended_by: CancelReason | None = None  # why it ended early (DELETE, a slow reader, a disconnect); set once
    # Once its SSE has begun: (code, message) -> the bytes that end the stream with that error
    # (an error event and [DONE], framed as the response is); see `last_words`.
    farewell: Callable[[str, str], bytes] | None = None
    # Cancels its rows on the GPU now (set once they are submitted): a DELETE must stop the work
    # even while the handler is blocked writing to a client that reads nothing.
    cancel_gpu: Callable[[], None] | None = None

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
            if self.cancel_gpu is not None:
                self.cancel_gpu()
            self.stream.feed(LocalCancel(reason))
        return first


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
