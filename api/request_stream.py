"""One request's channel back from the GPU process, as the worker's handlers read it: its admission
answer, then its records in an inbox (`Inbox`, shared by the streams of a batched request)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import msgspec

from ringserve.shm.messages import Accepted, Error, Finish, Pooled, PromptLogprobs, Rejected, Submit, Token


@dataclass(frozen=True, slots=True)
class PromptScores:
    """A `PromptLogprobs` record, tagged with its stream's prompt index (a batched request)."""

    prompt: int
    record: PromptLogprobs


@dataclass(frozen=True, slots=True)
class PooledChunk:
    """A `Pooled` record (an embedding's hidden-state sum), tagged with its stream's prompt index."""

    prompt: int
    record: Pooled


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
    """One Submit's channel: its admission answer, then Token / Finish / PromptScores / PooledChunk
    / Error records into its inbox. The streams of a batched request (one Submit per prompt) share
    an inbox; stream `prompt` renumbers its samples from `offset` (= prompt * n)."""

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
        elif kind is Pooled:
            item = PooledChunk(self.prompt, item)
        self.inbox.feed(item)

    async def next_batch(self) -> list:
        """Everything that arrived (for every stream sharing the inbox) since the last call."""
        return await self.inbox.next_batch()

    def set_admission(self, msg: Accepted | Rejected | Error) -> None:
        if not self.admission.done():
            self.admission.set_result(msg)
