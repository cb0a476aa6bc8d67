"""Cross-worker DELETE over the workers' private Unix sockets."""

from __future__ import annotations

import asyncio
import os

import pytest

from ringserve.api.generation import LocalCancel
from ringserve.api.gpu_client import RequestStream
from ringserve.api.peer_cancel import PeerCancel
from ringserve.api.registry import OpenRequest, Registry

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
        owned_id = regs[1].new_id(None)  # cmpl-1-...: names its worker
        regs[1].add(OpenRequest(owned_id, "tenant-a", stream, None))
        regs[2].add(OpenRequest("client-chosen", "tenant-a", RequestStream(2, asyncio.get_running_loop()), None))
        assert await peers[0].cancel(owned_id, "tenant-b") is False
        assert await peers[0].cancel("cmpl-1-unknown", "tenant-a") is False
        assert await peers[0].cancel(owned_id, "tenant-a") is True
        assert regs[1].get(owned_id).ended_by == "delete"
        assert isinstance((await stream.next_batch())[0], LocalCancel)
        assert await peers[0].cancel("client-chosen", "tenant-a") is True  # asked every peer
    finally:
        for peer in peers:
            await peer.stop()


async def test_gone_peer_counts_as_not_found():
    """A peer that is not listening (restarting) makes the cancel answer False, not an error."""
    peer = PeerCancel(f"{os.getpid()}-gone", 0, 2)
    assert await peer.cancel("cmpl-1-x", "t") is False
