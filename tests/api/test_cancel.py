"""Ending a request early: DELETE, client disconnect, slow reader. Each must cancel the GPU row."""

from __future__ import annotations

import asyncio
import socket

import pytest

from ringserve.api.fake_gpu import FakeGpu
from tests.helpers.sse import sse_events

pytestmark = pytest.mark.asyncio

_BODY = {"prompt": "cancel me please", "max_tokens": 1000, "stream": True}


async def _until(cond, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not cond():
            await asyncio.sleep(0.005)


async def test_delete_cancels_the_stream(serve):
    """DELETE by the submitting key ends the stream with finish_reason cancelled and usage."""
    served = await serve(fake=FakeGpu(step_interval_s=0.002))
    resp = await served.client.post("/v1/completions", json=_BODY)
    await resp.content.readuntil(b"\n\n")
    request_id = resp.headers["x-request-id"]
    deleted = await served.client.delete(f"/v1/requests/{request_id}")
    assert deleted.status == 200 and (await deleted.json())["cancelled"] is True
    events = sse_events(await resp.read())
    assert events[-2]["choices"][0]["finish_reason"] == "cancelled"
    assert events[-2]["usage"]["completion_tokens"] >= 1 and events[-1] == "[DONE]"
    assert [c.reason for c in served.fake.cancels] == ["cancelled"]
    assert served.fake.running == 0 and len(served.state.registry) == 0


async def test_a_second_delete_while_the_first_settles_is_404(serve):
    """A request that is already ending is no longer open: a second DELETE, sent while the first
    one's GPU rows still wind down, gets 404 and sends no second Cancel."""
    fake = FakeGpu(step_interval_s=0.002)
    served = await serve(fake=fake)
    resp = await served.client.post("/v1/completions", json=_BODY)
    await resp.content.readuntil(b"\n\n")
    request_id = resp.headers["x-request-id"]
    fake.paused = True  # the GPU's Finish for the Cancel does not come: the handler settles
    first = await served.client.delete(f"/v1/requests/{request_id}")
    await _until(lambda: len(fake.cancels) == 1)
    second = await served.client.delete(f"/v1/requests/{request_id}")
    assert (first.status, second.status) == (200, 404), await second.text()
    assert len(served.state.registry) == 1  # still settling: the 404 is not because it was gone
    fake.resume()
    await resp.read()
    assert [c.reason for c in fake.cancels] == ["cancelled"]


async def test_delete_stops_the_gpu_work_of_a_client_that_reads_nothing(serve):
    """DELETE cancels the GPU rows at once, even while the handler is blocked writing to a
    stream whose client reads nothing (not only when the slow-reader watchdog fires)."""
    served = await serve(fake=FakeGpu(), slow_reader_s=60, max_tokens_limit=4000)
    port = served.client.server.port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the handler's writes block soon
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = b'{"prompt":"stuck reader","max_tokens":4000,"ignore_eos":true,"stream":true}'
    await loop.sock_sendall(
        sock,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: stuck-reader\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
    )
    entry = None
    async with asyncio.timeout(10.0):  # until its writes are blocked
        while entry is None or not entry.write_since:
            entry = next(iter(served.state.registry.values()), None)
            await asyncio.sleep(0.01)
    deleted = await served.client.delete("/v1/requests/stuck-reader")
    assert deleted.status == 200
    await _until(lambda: served.fake.cancels, timeout=2.0)
    assert [c.reason for c in served.fake.cancels] == ["cancelled"]
    sock.close()


async def test_delete_of_unknown_request_is_404(serve):
    """An id that is not open is 404."""
    served = await serve()
    resp = await served.client.delete("/v1/requests/cmpl-nope")
    assert resp.status == 404 and (await resp.json())["error"]["code"] == "request_not_found"


async def test_delete_by_another_key_is_404(serve):
    """Only the key that submitted a request may cancel it."""
    served = await serve(fake=FakeGpu(step_interval_s=0.002), keys=frozenset({"alice", "bob"}))
    resp = await served.client.post("/v1/completions", json=_BODY, headers={"Authorization": "Bearer alice"})
    await resp.content.readuntil(b"\n\n")
    request_id = resp.headers["x-request-id"]
    other = await served.client.delete(f"/v1/requests/{request_id}", headers={"Authorization": "Bearer bob"})
    assert other.status == 404
    assert served.fake.cancels == []
    mine = await served.client.delete(f"/v1/requests/{request_id}", headers={"Authorization": "Bearer alice"})
    assert mine.status == 200
    await resp.read()


async def test_disconnect_cancels_the_row(serve):
    """A client that closes its connection mid-stream gets its GPU row cancelled."""
    served = await serve(fake=FakeGpu(step_interval_s=0.002))
    resp = await served.client.post("/v1/completions", json=_BODY)
    await resp.content.readuntil(b"\n\n")
    resp.close()
    await _until(lambda: served.fake.cancels)
    assert served.fake.cancels[0].reason == "disconnect"
    await _until(lambda: served.fake.running == 0 and len(served.state.registry) == 0)
    assert served.state.stats.get("disconnects") == 1


async def test_disconnect_while_queued_cancels(serve):
    """A client that leaves before its first token is cancelled too (no prefill for it)."""
    served = await serve(fake=FakeGpu(paused=True))
    task = asyncio.create_task(served.client.post("/v1/completions", json=_BODY))
    await _until(lambda: served.fake.submits)
    await asyncio.sleep(0.05)  # the response headers are out; no token yet
    (await task).close()
    await _until(lambda: served.fake.cancels)
    assert served.fake.cancels[0].reason == "disconnect"


async def test_slow_reader_is_cancelled_and_closed(serve):
    """A client that reads nothing is cancelled after slow_reader_s and its connection closed."""
    served = await serve(fake=FakeGpu(), slow_reader_s=0.3, max_tokens_limit=4000)
    port = served.client.server.port
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # fill up quickly
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    await loop.sock_connect(sock, ("127.0.0.1", port))
    body = b'{"prompt":"slow reader test","max_tokens":4000,"stream":true}'
    await loop.sock_sendall(
        sock,
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
        b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body,
    )
    await _until(lambda: served.fake.cancels, timeout=10.0)
    assert served.fake.cancels[0].reason == "slow_reader"
    assert served.state.stats.get("slow_reader_cancels") == 1
    # The server closed the connection: draining what was buffered ends in EOF or a reset.
    received = b""
    try:
        async with asyncio.timeout(5.0):
            while chunk := await loop.sock_recv(sock, 1 << 16):
                received += chunk
    except ConnectionResetError:
        pass
    sock.close()
    assert b"[DONE]" not in received


class _Unanswered(FakeGpu):
    """A GPU that takes Submits and never answers them (admission pending forever)."""

    def send(self, msg) -> bool:
        return True


async def test_every_disconnect_is_counted_once_whatever_the_phase(serve, codec):
    """A client leaving while its prompt is tokenized, while it waits for admission, mid-stream,
    or while a non-streaming answer is generated counts one disconnect each (issue 15: the
    counter rose by 968 for 1,000 disconnects)."""
    long_prompt = ("The quick brown fox jumps over the lazy dog. " * 40000)[:1_600_000]
    served = await serve(fake=FakeGpu(step_interval_s=0.002), context_limit=2_000_000, max_tokens_limit=1000)
    # 1. while tokenizing (off the loop: about a second for this prompt)
    task = asyncio.create_task(served.client.post("/v1/completions", json={"prompt": long_prompt, "max_tokens": 5}))
    await asyncio.sleep(0.2)
    task.cancel()
    await _until(lambda: served.state.stats.get("disconnects") == 1)
    assert not served.fake.submits
    # 2. mid-stream, 3. non-streaming while generating
    resp = await served.client.post("/v1/completions", json=_BODY)
    await resp.content.readuntil(b"\n\n")
    resp.close()
    task = asyncio.create_task(served.client.post("/v1/completions", json={**_BODY, "stream": False}))
    await _until(lambda: len(served.fake.submits) == 2)
    task.cancel()
    await _until(lambda: served.state.stats.get("disconnects") == 3 and len(served.state.registry) == 0)
    # 4. while waiting for admission
    served.state.client.transport = _Unanswered()
    task = asyncio.create_task(served.client.post("/v1/completions", json=_BODY))
    await _until(lambda: len(served.state.registry) == 1)
    task.cancel()
    await _until(lambda: len(served.state.registry) == 0)
    await asyncio.sleep(0.1)
    assert served.state.stats.get("disconnects") == 4
