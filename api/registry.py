"""The requests open in this worker, by request id: for DELETE and for x-request-id uniqueness."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

from ringserve.api.generation import LocalCancel
from ringserve.api.gpu_client import RequestStream

_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")


@dataclass(slots=True)
class OpenRequest:
    """An open request as DELETE and the slow-reader watchdog see it."""

    request_id: str
    tenant: str
    stream: RequestStream
    transport: Any  # the client connection's asyncio transport (None once it closed)
    write_since: float = 0.0  # loop.time() when a still-blocked write started; 0: not writing
    ended_by: str | None = None  # "delete" | "slow_reader" | "disconnect" once it ended early

    def end(self, reason: str) -> None:
        """End the request from the worker's side: "delete" or "slow_reader"."""
        if self.ended_by is None:
            self.ended_by = reason
        if reason == "slow_reader":
            # Closing the connection ends the handler (cancelled, or its blocked write fails).
            if self.transport is not None:
                self.transport.abort()
        else:
            self.stream.feed(LocalCancel(reason))


class Registry:
    """Request ids are unique within the worker; generated ones carry the worker index and a
    random part, so they are unique across workers too."""

    def __init__(self, worker: int) -> None:
        self.worker = worker
        self._open: dict[str, OpenRequest] = {}
        self._counter = 0
        self._salt = os.urandom(4).hex()

    def new_id(self, client_id: str | None) -> str:
        """The client's x-request-id when it is well-formed and not in use, else a fresh one."""
        if client_id and _CLIENT_ID.match(client_id) and client_id not in self._open:
            return client_id
        self._counter += 1
        return f"cmpl-{self.worker}-{self._salt}{self._counter:x}"

    def add(self, entry: OpenRequest) -> None:
        self._open[entry.request_id] = entry

    def remove(self, request_id: str) -> None:
        self._open.pop(request_id, None)

    def get(self, request_id: str) -> OpenRequest | None:
        return self._open.get(request_id)

    def __len__(self) -> int:
        return len(self._open)

    def values(self):
        return self._open.values()
