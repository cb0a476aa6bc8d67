"""Many concurrent streams through one worker: each gets exactly its own tokens and request id."""

from __future__ import annotations

import asyncio

import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio


async def test_concurrent_streams_never_mix(serve, codec):
    """150 concurrent streams, each prompt carrying a unique marker: no output or event holds
    another request's marker or request id."""
    served = await serve(fake=FakeGpu(step_interval_s=0.001))
    markers = [f"marker-{i:03d}-{'xyz'[i % 3]}" for i in range(150)]

    async def one(marker: str):
        text = f"{marker} 🎉 end"
        resp = await served.client.post(
            "/v1/completions", json={"prompt": text, "max_tokens": len(codec.encode(text)), "stream": True}
        )
        assert resp.status == 200
        return text, resp.headers["x-request-id"], sse_events(await resp.read())

    results = await asyncio.gather(*(one(m) for m in markers))
    ids = [request_id for _, request_id, _ in results]
    assert len(set(ids)) == len(ids)
    for text, request_id, events in results:
        assert "".join(e["text"] for e in events if "token_id" in e) == text
        assert all(e["request_id"] == request_id for e in events[:-1])
    assert served.fake.running == 0 and len(served.state.registry) == 0
