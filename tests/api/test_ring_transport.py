"""The ring transport over a real shared-memory instance, with the test acting as the GPU side."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest

from ringserve.api.gpu_client import GpuClient
from ringserve.api.ring_transport import RingTransport
from ringserve.shm.instance import ShmInstance
from ringserve.shm.messages import (
    Accepted,
    Error,
    Finish,
    SamplingParams,
    StepOutput,
    Submit,
    Token,
    decode,
    encode,
    fingerprint,
)

pytestmark = pytest.mark.asyncio


@pytest.fixture
def instance(tmp_path):
    inst = ShmInstance.create(ring_bytes=1 << 16, n_workers=1, directory=str(tmp_path))
    yield inst
    inst.close()
    inst.unlink()


def _submit(rid: int, deadline_ts: float = 1.0) -> Submit:
    return Submit(
        rid=rid,
        request_id=f"r{rid}",
        tenant="t",
        prompt_ids=[1, 2, 3],
        max_tokens=2,
        sampling=SamplingParams(),
        arrival_ts=0.0,
        deadline_ts=deadline_ts,
    )


async def test_submit_and_step_output_over_rings(instance):
    """A Submit reaches the GPU's request ring and rings its bell; pushed records are delivered."""
    client = GpuClient(RingTransport.for_slot(instance, 0))
    client.start()
    gpu_in, gpu_out = instance.gpu_rings(instance.control.gpu_generation)
    stream = client.open_stream()
    admitted = asyncio.create_task(client.submit(stream, _submit(stream.rid)))
    await asyncio.sleep(0)
    assert instance.input_bell.wait(1.0)
    sent = _submit(stream.rid)
    assert decode(gpu_in[0].pop()) == msgspec.structs.replace(sent, fingerprint=fingerprint(sent, b""))
    for msg in (
        Accepted(rid=stream.rid, est_gpu_ms=2.0),
        StepOutput(
            step=1, tokens=[Token(stream.rid, 0, 7, -0.1)], finishes=[Finish(stream.rid, 0, "length", 3, 1, 0.5, 4.0)]
        ),
    ):
        assert gpu_out[0].try_push(encode(msg))
    instance.output_bells[0].ring()
    async with asyncio.timeout(2):
        assert (await admitted).est_gpu_ms == 2.0
        items = await stream.next_batch()
    assert [type(i).__name__ for i in items] == ["Token", "Finish"] and items[0].token_id == 7
    client.cancel(stream.rid)
    assert decode(gpu_in[0].pop()).rid == stream.rid
    client.close()


async def test_generation_change_fails_streamed_and_resubmits_the_rest(instance):
    """A new ring generation (GPU process restarted), found even without a bell: the request that
    streamed a token gets the gpu_process_restart error; the one without tokens is resubmitted,
    under a new rid, once the GPU process is READY again."""
    ready = [True]
    client = GpuClient(RingTransport.for_slot(instance, 0), ready=lambda: ready[0])
    client.start()
    gpu_in, gpu_out = instance.gpu_rings(instance.control.gpu_generation)
    a, b = client.open_stream(), client.open_stream()
    for s in (a, b):
        asyncio.create_task(client.submit(s, _submit(s.rid, deadline_ts=time.time() + 60)))
    await asyncio.sleep(0)
    assert gpu_out[0].try_push(encode(StepOutput(step=1, tokens=[Token(a.rid, 0, 9, 0.0)])))
    instance.output_bells[0].ring()
    async with asyncio.timeout(2):
        assert isinstance((await a.next_batch())[0], Token)
    while gpu_in[0].pop() is not None:
        pass  # the first process read them
    ready[0] = False
    old_b = b.rid
    gpu_out[0].adopt_producer(generation=gpu_out[0].generation + 1)  # no bell: found by polling
    async with asyncio.timeout(2):
        items = await a.next_batch()
    assert isinstance(items[0], Error) and items[0].code == "gpu_process_restart"
    await asyncio.sleep(0.1)
    assert gpu_in[0].pop() is None  # nothing is sent while the GPU process is not ready
    ready[0] = True
    async with asyncio.timeout(2):
        while b.rid == old_b:
            await asyncio.sleep(0.01)
    sent = [decode(gpu_in[0].pop()), decode(gpu_in[0].pop())]
    assert sent[0].rid == old_b and type(sent[0]).__name__ == "Cancel"
    assert isinstance(sent[1], Submit) and sent[1].rid == b.rid
    assert sent[1].request_id == f"r{old_b}" and sent[1].prompt_ids == [1, 2, 3]
    client.close()


async def test_backlog_is_delivered_in_bounded_batches(instance):
    """A backlog larger than one batch is delivered whole and in order after a single bell."""
    client = GpuClient(RingTransport.for_slot(instance, 0))
    client.start()
    _, gpu_out = instance.gpu_rings(instance.control.gpu_generation)
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
