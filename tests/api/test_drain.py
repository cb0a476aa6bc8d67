"""SIGTERM drain of one worker (`api.worker.serve`) over a real socket with the fake GPU: streams
that finish within the drain timeout complete; the rest get the server_shutdown error event and
[DONE], never a dropped connection."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from ringserve.api.app import init_app
from ringserve.api.fake_gpu import FakeGpu, FakeStatus
from ringserve.api.gpu_client import GpuClient
from ringserve.api.worker import listen_socket, serve
from ringserve.config import Config
from tests.helpers.fake_api import MODEL
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio


async def _read_stream(session: aiohttp.ClientSession, url: str, max_tokens: int, first: asyncio.Event) -> list:
    async with session.post(
        url + "/v1/completions", json={"prompt": "drain", "max_tokens": max_tokens, "stream": True}
    ) as resp:
        assert resp.status == 200
        raw = b""
        async for chunk in resp.content.iter_any():
            raw += chunk
            first.set()
        return sse_events(raw)


async def test_drain_finishes_short_streams_and_ends_long_ones_with_the_error_event(codec):
    """At the drain deadline an unfinished stream gets server_shutdown + [DONE]; a short one completes."""
    fake = FakeGpu(step_interval_s=0.02)
    config = Config(drain_timeout_s=0.5)
    app = init_app(config, GpuClient(fake), codec, FakeStatus(fake), model_name=MODEL)
    sock = listen_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop = asyncio.Event()
    server = asyncio.create_task(serve(config, app, sock, stop))
    try:
        async with aiohttp.ClientSession() as session:
            firsts = [asyncio.Event(), asyncio.Event()]
            short = asyncio.create_task(_read_stream(session, url, 10, firsts[0]))
            long = asyncio.create_task(_read_stream(session, url, 1000, firsts[1]))
            async with asyncio.timeout(10):
                await asyncio.gather(*(e.wait() for e in firsts))
            stop.set()
            await asyncio.sleep(0.05)
            async with session.get(url + "/ready") as ready:
                assert ready.status == 503
            short_events, long_events = await asyncio.wait_for(asyncio.gather(short, long), 10)
        assert short_events[-1] == "[DONE]" and "usage" in short_events[-2]
        assert long_events[-1] == "[DONE]"
        err = long_events[-2]["error"]
        assert err["type"] == "server_shutdown" == err["code"]
        assert err["tokens_streamed"] == sum(1 for e in long_events[:-2] if e["choices"])
        await asyncio.wait_for(server, 10)
        assert fake.cancels  # the unfinished row was cancelled, so its blocks come back
    finally:
        if not server.done():
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        sock.close()


async def test_unready_lead_fails_ready_first_while_requests_still_run(codec):
    """With unready_lead_s, SIGTERM fails /ready at once but new requests are served until the
    lead is over; then they get 503 server_draining (a balancer has stopped sending by then)."""
    fake = FakeGpu(step_interval_s=0.005)
    config = Config(drain_timeout_s=1.0, unready_lead_s=0.6)
    app = init_app(config, GpuClient(fake), codec, FakeStatus(fake), model_name=MODEL)
    sock = listen_socket("127.0.0.1", 0)
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    stop = asyncio.Event()
    server = asyncio.create_task(serve(config, app, sock, stop))
    body = {"prompt": "lead", "max_tokens": 2}
    try:
        async with aiohttp.ClientSession() as session:
            first = asyncio.Event()
            open_stream = asyncio.create_task(_read_stream(session, url, 1000, first))  # keeps the drain going
            async with asyncio.timeout(10):
                await first.wait()
            stop.set()
            await asyncio.sleep(0.05)
            async with session.get(url + "/ready") as ready:
                assert ready.status == 503
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 200  # still serving during the lead
            await asyncio.sleep(0.7)
            async with session.post(url + "/v1/completions", json=body) as resp:
                assert resp.status == 503
                assert (await resp.json())["error"]["code"] == "server_draining"
            await asyncio.wait_for(open_stream, 10)
        await asyncio.wait_for(server, 10)
    finally:
        if not server.done():
            server.cancel()
            await asyncio.gather(server, return_exceptions=True)
        sock.close()
