"""Cross-worker DELETE over the workers' private Unix sockets."""

from __future__ import annotations

import asyncio
import os

import pytest

from ringserve.api.app import init_app
from ringserve.api.fake_gpu import FakeGpu, FakeStatus
from ringserve.api.generation import LocalCancel
from ringserve.api.gpu_client import GpuClient
from ringserve.api.peer_cancel import PeerCancel
from ringserve.api.registry import OpenRequest, Registry
from ringserve.api.request_stream import RequestStream
from ringserve.config import Config
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio


async def test_peer_cancels_only_for_the_submitting_tenant():
    """A worker without the id asks the owner; the owner cancels only for the right tenant."""
    instance = f"{os.getpid()}-{id(object())}"
    regs = [Registry(0), Registry(1), Registry(2)]
    peers = [PeerCancel(instance, slot, 3) for slot in range(3)]
    for peer, reg in zip(peers, regs):
        await peer.start(reg)
    try:
        stream = RequestStream(1, asyncio.get_running_loop())
        owned_id = regs[1].new_id(None, "tenant-a")  # cmpl-1-...: names its worker
        regs[1].add(OpenRequest(owned_id, "tenant-a", [stream], None, GpuClient(FakeGpu())))
        regs[2].add(
            OpenRequest(
                "client-chosen", "tenant-a", [RequestStream(2, asyncio.get_running_loop())], None, GpuClient(FakeGpu())
            )
        )
        assert await peers[0].cancel(owned_id, "tenant-b") is False
        assert await peers[0].cancel("cmpl-1-unknown", "tenant-a") is False
        assert await peers[0].cancel(owned_id, "tenant-a") is True
        assert regs[1].get(owned_id, "tenant-a").ended_by == "delete"
        assert isinstance((await stream.next_batch())[0], LocalCancel)
        assert await peers[2].cancel(owned_id, "tenant-a") is False  # already ending: not open
        assert await peers[0].cancel("client-chosen", "tenant-a") is True  # asked every peer
    finally:
        for peer in peers:
            await peer.stop()


async def test_gone_peer_counts_as_not_found():
    """A peer that is not listening (restarting) makes the cancel answer False, not an error."""
    peer = PeerCancel(f"{os.getpid()}-gone", 0, 2)
    assert await peer.cancel("cmpl-1-x", "t") is False


async def test_same_client_id_from_another_tenant_does_not_hide_a_request(aiohttp_client, codec):
    """Tenant B reusing tenant A's x-request-id on another worker neither changes B's id nor
    stops A's DELETE, whichever worker receives it (issue 15, break 6: A got 404)."""
    instance = f"{os.getpid()}-{id(object())}"
    fakes = [FakeGpu(step_interval_s=0.01), FakeGpu(step_interval_s=0.01)]
    clients = []
    for slot in range(2):
        app = init_app(
            Config(),
            GpuClient(fakes[slot]),
            codec,
            FakeStatus(fakes[slot]),
            model_name="m",
            worker=slot,
            peers=PeerCancel(instance, slot, 2),
        )
        clients.append(await aiohttp_client(app))
    body = {"prompt": "hello", "max_tokens": 1000, "ignore_eos": True, "stream": True}
    a = await clients[0].post(
        "/v1/completions", json=body, headers={"authorization": "Bearer key-a", "x-request-id": "dup"}
    )
    b = await clients[1].post(
        "/v1/completions", json=body, headers={"authorization": "Bearer key-b", "x-request-id": "dup"}
    )
    b_same = await clients[0].post(
        "/v1/completions", json=body, headers={"authorization": "Bearer key-b", "x-request-id": "dup"}
    )
    assert a.headers["x-request-id"] == b.headers["x-request-id"] == b_same.headers["x-request-id"] == "dup"
    await a.content.readuntil(b"\n\n")
    deleted = await clients[1].delete("/v1/requests/dup", headers={"authorization": "Bearer key-a"})
    assert deleted.status == 200
    events = sse_events(await a.read())
    assert events[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert len(fakes[1].cancels) == 0 and fakes[1].running == 1  # B's requests run on
    assert fakes[0].running == 1
    assert (await clients[0].delete("/v1/requests/dup", headers={"authorization": "Bearer key-c"})).status == 404
    b.close()
    b_same.close()
