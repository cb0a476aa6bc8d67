"""The ring transport over a real shared-memory instance, with the test acting as the GPU side."""

from __future__ import annotations

import asyncio

import pytest

from ringserve.api.gpu_client import GpuClient
from ringserve.api.ring_transport import RingTransport
from ringserve.shm.instance import ShmInstance
from ringserve.shm.messages import (Accepted, Error, Finish, SamplingParams, StepOutput, Submit,
                                    Token, decode, encode)

pytestmark = pytest.mark.asyncio


@pytest.fixture
def instance(tmp_path):
    inst = ShmInstance.create(ring_bytes=1 << 16, n_workers=1, directory=str(tmp_path))
    yield inst
    inst.close()
    inst.unlink()


def _submit(rid: int) -> Submit:
    return Submit(rid=rid, request_id=f"r{rid}", tenant="t", prompt_ids=[1, 2, 3], max_tokens=2,
                  sampling=SamplingParams(), arrival_ts=0.0, deadline_ts=1.0)


async def test_submit_and_step_output_over_rings(instance):
    """A Submit reaches the GPU's request ring and rings its bell; pushed records are delivered."""
    client = GpuClient(RingTransport.for_slot(instance, 0))
    client.start()
    gpu_in, gpu_out = instance.gpu_rings()
    stream = client.open_stream()
    admitted = asyncio.create_task(client.submit(stream, _submit(stream.rid)))
    await asyncio.sleep(0)
    assert instance.input_bell.wait(1.0)
    assert decode(gpu_in[0].pop()) == _submit(stream.rid)
    for msg in (Accepted(rid=stream.rid, est_gpu_ms=2.0),
                StepOutput(step=1, tokens=[Token(stream.rid, 0, 7, -0.1)],
                           finishes=[Finish(stream.rid, 0, "length", 3, 1, 0.5, 4.0)])):
        assert gpu_out[0].try_push(encode(msg))
    instance.output_bells[0].ring()
    async with asyncio.timeout(2):
        assert (await admitted).est_gpu_ms == 2.0
        items = await stream.next_batch()
    assert [type(i).__name__ for i in items] == ["Token", "Finish"] and items[0].token_id == 7
    client.cancel(stream.rid)
    assert decode(gpu_in[0].pop()).rid == stream.rid
    client.close()


async def test_generation_change_fails_open_requests(instance):
    """A new ring generation (GPU process restarted) gives every open request an error, even
    when the new GPU process never rings this worker's bell."""
    client = GpuClient(RingTransport.for_slot(instance, 0))
    client.start()
    _, gpu_out = instance.gpu_rings()
    stream = client.open_stream()
    gpu_out[0].adopt_producer(generation=gpu_out[0].generation + 1)  # no bell: found by polling
    async with asyncio.timeout(2):
        items = await stream.next_batch()
    assert isinstance(items[0], Error) and items[0].code == "gpu_restart"
    client.close()


async def test_backlog_is_delivered_in_bounded_batches(instance):
    """A backlog larger than one batch is delivered whole and in order after a single bell."""
    client = GpuClient(RingTransport.for_slot(instance, 0))
    client.start()
    _, gpu_out = instance.gpu_rings()
    stream = client.open_stream()
    for step in range(40):
        assert gpu_out[0].try_push(encode(StepOutput(step=step, tokens=[Token(stream.rid, 0, step, 0.0)])))
    instance.output_bells[0].ring()
    got: list[int] = []
    async with asyncio.timeout(2):
        while len(got) < 40:
            got += [t.token_id for t in await stream.next_batch()]
    assert got == list(range(40))
    client.close()
