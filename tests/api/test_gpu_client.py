"""The worker's protocol client: ordering under a full ring, routing, admission answers."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from ringserve.api.errors import ApiError
from ringserve.api.gpu_client import GpuClient
from ringserve.shm.messages import Accepted, Cancel, Error, Finish, Rejected, SamplingParams, StepOutput, Submit, Token
from ringserve.shm.ring import RecordTooLarge

pytestmark = pytest.mark.asyncio


class _Ring:
    """A transport whose ring takes only `room` messages until the test makes more room."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.sent: list = []
        self.deliver = None

    def open(self, deliver) -> None:
        self.deliver = deliver

    def send(self, msg) -> bool:
        if self.room == 0:
            return False
        self.room -= 1
        self.sent.append(msg)
        return True

    def close(self) -> None:
        self.deliver = None


def _submit(rid: int) -> Submit:
    return Submit(
        rid=rid,
        request_id=f"r{rid}",
        tenant="t",
        prompt_ids=[1],
        max_tokens=4,
        sampling=SamplingParams(),
        arrival_ts=0.0,
        deadline_ts=1.0,
    )


async def test_full_ring_keeps_order_and_loses_nothing():
    """Messages refused by a full ring are retried in order; a Cancel never overtakes its Submit."""
    ring = _Ring(room=1)
    client = GpuClient(ring)
    client.start()
    a, b = client.open_stream(), client.open_stream()
    task_a = asyncio.create_task(client.submit(a, _submit(a.rid)))
    task_b = asyncio.create_task(client.submit(b, _submit(b.rid)))
    await asyncio.sleep(0)
    client.cancel(b.rid)
    assert [type(m).__name__ for m in ring.sent] == ["Submit"]
    ring.room = 10
    async with asyncio.timeout(2):
        while len(ring.sent) < 3:
            await asyncio.sleep(0.001)
    assert [(type(m), m.rid) for m in ring.sent] == [(Submit, a.rid), (Submit, b.rid), (Cancel, b.rid)]
    ring.deliver(Accepted(rid=a.rid, est_gpu_ms=1.0))
    ring.deliver(Rejected(rid=b.rid, status=429, code="queue_full", message="busy", retry_after_s=2.0))
    assert isinstance(await task_a, Accepted)
    with pytest.raises(ApiError) as err:
        await task_b
    assert err.value.status == 429 and err.value.retry_after_s == 2.0
    assert client.open_requests == 1  # the refused request was released


async def test_step_output_routed_per_request():
    """Each request's stream gets only its own tokens and finishes, in order."""
    ring = _Ring(room=10)
    client = GpuClient(ring)
    client.start()
    a, b = client.open_stream(), client.open_stream()
    ring.deliver(
        StepOutput(
            step=1,
            tokens=[Token(a.rid, 0, 5, -1.0), Token(b.rid, 0, 6, -1.0), Token(99, 0, 7, -1.0)],
            finishes=[Finish(a.rid, 0, "length", 1, 1, 0.0, 0.0)],
        )
    )
    got_a = await a.next_batch()
    got_b = await b.next_batch()
    assert [type(x).__name__ for x in got_a] == ["Token", "Finish"] and got_a[0].token_id == 5
    assert [x.token_id for x in got_b] == [6]


async def test_error_for_all_reaches_every_stream():
    """An Error without a rid (other than a restart) fails pending admissions and open streams."""
    ring = _Ring(room=10)
    client = GpuClient(ring)
    client.start()
    a, b = client.open_stream(), client.open_stream()
    ring.deliver(Accepted(rid=a.rid, est_gpu_ms=1.0))
    ring.deliver(Error(code="gpu_fatal", message="the engine failed"))
    assert isinstance((await a.next_batch())[0], Error)
    with pytest.raises(ApiError) as err:
        await client.submit(b, _submit(b.rid))
    assert err.value.status == 503


async def test_row_error_finish_fails_the_request(codec):
    """A Finish with reason error turns into an error event, not a normal finish."""
    from ringserve.api.generation import Generation
    from ringserve.api.sse import EventEncoder

    gen = Generation(codec, n=1, stop=(), prompts=[[1]], arrival=0.0, encoder=EventEncoder("r1", "m", 0))
    out = gen.consume([Token(1, 0, 5, -1.0), Finish(1, 0, "error", 1, 1, 0.0, 0.0)])
    assert gen.finished and gen.error is not None and gen.error.code == "gpu_error"
    assert b'"error"' in out[-1] and b'"finish_reason"' not in out[-1]


async def test_cancelled_while_awaiting_admission_sends_cancel():
    """A client that leaves before admission still gets its request cancelled on the GPU side."""
    ring = _Ring(room=10)
    client = GpuClient(ring)
    client.start()
    stream = client.open_stream()
    task = asyncio.create_task(client.submit(stream, _submit(stream.rid)))
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert [(type(m), m.rid) for m in ring.sent] == [(Submit, stream.rid), (Cancel, stream.rid)]
    assert ring.sent[1].reason == "disconnect" and client.open_requests == 0


async def test_message_the_ring_can_never_take_is_refused_not_parked():
    """A Submit over the ring's record limit is answered 413 at once; it is never parked, so the
    requests after it still go out (issue 15, break 4)."""

    class _Small(_Ring):
        def send(self, msg) -> bool:
            if isinstance(msg, Submit) and len(msg.prompt_ids) > 1:
                raise RecordTooLarge("record of 9,999,999 bytes exceeds what a ring takes")
            return super().send(msg)

    transport = _Small(room=10)
    client = GpuClient(transport)
    client.start()
    big = client.open_stream()
    with pytest.raises(ApiError) as info:
        await client.submit(big, msgspec.structs.replace(_submit(big.rid), prompt_ids=[1, 2]))
    assert info.value.status == 413 and info.value.code == "request_too_large"
    small = client.open_stream()
    task = asyncio.create_task(client.submit(small, _submit(small.rid)))
    await asyncio.sleep(0.01)
    assert [m.rid for m in transport.sent] == [small.rid]
    transport.deliver(Accepted(rid=small.rid, est_gpu_ms=1.0))
    assert isinstance(await task, Accepted)
    client.close()
