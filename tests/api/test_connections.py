"""Every connection state has a time limit and a worker stays under its open-file limit: the real
worker `serve()` (its own listener, the connection guard) on loopback, with the fake GPU."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import socket
import struct
import subprocess
import sys
import time

import pytest

from ringserve.api.app import init_app
from ringserve.api.connections import SWEEP_S
from ringserve.api.fake_gpu import FakeGpu, FakeStatus
from ringserve.api.gpu_client import GpuClient
from ringserve.api.state import STATE
from ringserve.api.worker import listen_socket, serve
from ringserve.config import Config

pytestmark = pytest.mark.asyncio

SLACK_S = 1.0  # scheduling slack on a shared machine, on top of one sweep period


@contextlib.asynccontextmanager
async def running_worker(codec, fake: FakeGpu | None = None, **config):
    """A worker serving on an ephemeral loopback port; yields (port, app state)."""
    cfg = Config(**config)
    fake = fake or FakeGpu()
    app = init_app(cfg, GpuClient(fake), codec, FakeStatus(fake), model_name="m")
    sock = listen_socket("127.0.0.1", 0, cfg.listen_backlog)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, app, sock, stop))
    state = app[STATE]
    async with asyncio.timeout(10):
        while state.connections.max_connections == 0:  # set once listening
            await asyncio.sleep(0.01)
    try:
        yield sock.getsockname()[1], state
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        sock.close()


async def _connect(port: int, rcvbuf: int | None = None) -> socket.socket:
    s = socket.socket()
    if rcvbuf is not None:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    s.setblocking(False)
    await asyncio.get_running_loop().sock_connect(s, ("127.0.0.1", port))
    return s


def _tcp_state(s: socket.socket) -> int:
    return struct.unpack("B", s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)[:1])[0]


async def _closed_after(s: socket.socket, limit_s: float) -> float:
    """Seconds until the server closed `s` (FIN or reset seen), reading nothing; fails after
    `limit_s`."""
    t0 = time.monotonic()
    async with asyncio.timeout(limit_s):
        while _tcp_state(s) == 1:  # ESTABLISHED
            await asyncio.sleep(0.02)
    return time.monotonic() - t0


async def _read_response(s: socket.socket) -> tuple[bytes, bytes]:
    """(head, body) of one response read until the server closes the connection."""
    loop = asyncio.get_running_loop()
    data = b""
    async with asyncio.timeout(10):
        while chunk := await loop.sock_recv(s, 65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


async def test_idle_and_dribbling_connections_are_closed_after_header_timeout(codec):
    """A connection that sends nothing, and one that dribbles a request head, are both closed
    header_timeout_s after they connected (before: kept for an hour)."""
    async with running_worker(codec, header_timeout_s=0.5) as (port, state):
        idle = await _connect(port)
        drip = await _connect(port)
        head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Pad: "
        t0 = time.monotonic()

        async def dribble() -> None:
            for i in range(len(head)):
                with contextlib.suppress(OSError):
                    drip.send(head[i : i + 1])
                await asyncio.sleep(0.05)

        feeder = asyncio.create_task(dribble())
        limit = 0.5 + SWEEP_S + SLACK_S
        await _closed_after(idle, limit)
        await _closed_after(drip, limit)
        assert time.monotonic() - t0 >= 0.4
        feeder.cancel()
        assert state.connections.timed_out == 2
        idle.close()
        drip.close()


async def test_idle_keepalive_connection_closed_after_keepalive_timeout(codec):
    """After a response, a kept-alive connection that sends nothing more is closed
    keepalive_timeout_s later."""
    async with running_worker(codec, keepalive_timeout_s=0.6, header_timeout_s=30) as (port, _):
        s = await _connect(port)
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(s, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert (await loop.sock_recv(s, 4096)).startswith(b"HTTP/1.1 200")
        waited = await _closed_after(s, 0.6 + SWEEP_S + SLACK_S)
        assert waited >= 0.5
        s.close()


async def test_slow_body_gets_408_and_the_connection_closes(codec):
    """A request body that does not arrive within body_timeout_s is answered 408 with the error
    object, and the connection is closed."""
    async with running_worker(codec, body_timeout_s=0.5) as (port, _):
        s = await _connect(port)
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        await loop.sock_sendall(
            s,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
            b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"pro',
        )
        head, body = await _read_response(s)
        assert 0.4 <= time.monotonic() - t0 <= 0.5 + SLACK_S + 2.0  # + the bounded linger
        assert head.startswith(b"HTTP/1.1 408")
        assert json.loads(body)["error"]["code"] == "body_timeout"
        s.close()


async def test_non_streaming_slow_reader_is_reset_after_slow_reader_s(codec):
    """A non-streaming client that reads none of a large answer loses its connection (a reset,
    so the kernel drops the unread bytes too) slow_reader_s after the answer was written."""
    fake = FakeGpu()
    async with running_worker(codec, fake, slow_reader_s=0.8) as (port, state):
        s = await _connect(port, rcvbuf=4096)
        body = json.dumps(
            {"prompt": "hello world " * 40, "max_tokens": 1000, "n": 16, "logprobs": 20, "ignore_eos": True}
        ).encode()
        await asyncio.get_running_loop().sock_sendall(
            s,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body,
        )
        async with asyncio.timeout(10):
            while fake.finished.get("length", 0) < 16:  # the answer is complete and being written
                await asyncio.sleep(0.01)
        waited = await _closed_after(s, 0.8 + SWEEP_S + SLACK_S + 1.0)
        assert waited >= 0.5
        assert _tcp_state(s) == 7  # CLOSE: a reset, not a FIN queued behind the unread bytes
        assert state.connections.timed_out == 1
        s.close()


async def test_slow_but_reading_client_keeps_its_connection(codec):
    """A client that takes a large answer slowly, but steadily, for longer than slow_reader_s gets
    all of it: only a client that takes nothing is cut off."""
    fake = FakeGpu()
    async with running_worker(codec, fake, slow_reader_s=0.6) as (port, state):
        s = await _connect(port, rcvbuf=4096)
        body = json.dumps(
            {"prompt": "hello world " * 40, "max_tokens": 1000, "n": 16, "logprobs": 20, "ignore_eos": True}
        ).encode()
        loop = asyncio.get_running_loop()
        await loop.sock_sendall(
            s,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % len(body) + body,
        )  # kept alive: the worker holds it
        async with asyncio.timeout(30):
            while fake.finished.get("length", 0) < 16:  # the answer is complete and being written
                await asyncio.sleep(0.01)
        received, t0 = b"", time.monotonic()
        async with asyncio.timeout(60):
            while b"\r\n\r\n" not in received or len(received.partition(b"\r\n\r\n")[2]) < int(
                received.split(b"Content-Length: ")[1].split(b"\r\n")[0]
            ):
                chunk = await loop.sock_recv(s, 4096)
                assert chunk, "the worker closed the connection"
                received += chunk
                await asyncio.sleep(0.03)  # at most about 130 kB/s
        head, _, payload = received.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        assert time.monotonic() - t0 > 3 * 0.6  # reading took well over slow_reader_s
        assert len(json.loads(payload)["choices"]) == 16
        assert state.connections.timed_out == 0
        s.close()


async def test_full_worker_closes_oldest_idle_connection_for_a_new_one(codec, caplog):
    """At max_connections a new connection takes the place of the oldest waiting one, and the
    worker says so in its log; when every connection is busy it refuses the new one, logged."""
    caplog.set_level(logging.WARNING, logger="ringserve.api.connections")
    fake = FakeGpu(paused=True)
    async with running_worker(codec, fake, max_connections=4, header_timeout_s=30) as (port, state):
        idle = [await _connect(port) for _ in range(4)]
        await asyncio.sleep(0.1)
        loop = asyncio.get_running_loop()
        probe = await _connect(port)
        await loop.sock_sendall(probe, b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        head, _ = await _read_response(probe)
        assert head.startswith(b"HTTP/1.1 200")
        assert await _closed_after(idle[0], 2.0) < 2.0  # the oldest made room
        assert "closed waiting or idle connections to make room" in caplog.text
        for s in idle + [probe]:
            s.close()
        await asyncio.sleep(0.2)
        busy = [await _connect(port) for _ in range(4)]
        req = json.dumps({"prompt": "hi", "max_tokens": 5, "stream": True}).encode()
        for s in busy:  # held by the paused fake GPU: every connection is handling a request
            await loop.sock_sendall(
                s, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(req) + req
            )
        async with asyncio.timeout(5):
            while state.client.open_requests < 4:
                await asyncio.sleep(0.01)
        refused = await _connect(port)
        assert await _closed_after(refused, 2.0) < 2.0
        assert "refused new connections" in caplog.text
        fake.resume()
        for s in busy + [refused]:
            s.close()


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
async def test_configured_listen_backlog_is_used(codec):
    """The listening socket's backlog is listen_backlog, not aiohttp's default of 128."""
    async with running_worker(codec, listen_backlog=777) as (port, _):
        out = subprocess.run(
            ["ss", "-ltnH", f"sport = :{port}"], capture_output=True, text=True, check=True
        ).stdout.split()
        assert out[2] == "777"  # Send-Q of a listening socket: its backlog


async def test_malformed_request_gets_the_error_object(codec):
    """aiohttp's own 400 for a malformed header is the OpenAI error object, not plain text."""
    async with running_worker(codec) as (port, _):
        s = await _connect(port)
        await asyncio.get_running_loop().sock_sendall(s, b"GET /health HTTP/1.1\r\nHost: x\r\nBad Header Line\r\n\r\n")
        head, body = await _read_response(s)
        assert head.split(b"\r\n")[0].endswith(b"400 Bad Request")
        assert b"application/json" in head
        err = json.loads(body)["error"]
        assert err["code"] == "invalid_http_request" and err["type"] == "invalid_request_error"
        s.close()


async def test_non_ascii_authorization_is_a_401(codec, tmp_path):
    """Authorization bytes that are not UTF-8 are an invalid key (401), not a 500."""
    cfg = Config()
    from ringserve.api.auth import Authenticator

    fake = FakeGpu()
    app = init_app(
        cfg, GpuClient(fake), codec, FakeStatus(fake), model_name="m", auth=Authenticator(frozenset({"good-key"}))
    )
    sock = listen_socket("127.0.0.1", 0)
    stop = asyncio.Event()
    task = asyncio.create_task(serve(cfg, app, sock, stop))
    try:
        async with asyncio.timeout(10):
            while app[STATE].connections.max_connections == 0:
                await asyncio.sleep(0.01)
        s = await _connect(sock.getsockname()[1])
        req = b'{"prompt": "hi", "max_tokens": 2}'
        await asyncio.get_running_loop().sock_sendall(
            s,
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\xe9t\xe9\r\n"
            b"Connection: close\r\nContent-Length: %d\r\n\r\n" % len(req) + req,
        )
        head, body = await _read_response(s)
        assert head.startswith(b"HTTP/1.1 401")
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
        s.close()
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        sock.close()


async def test_open_file_limit_is_raised_and_bounds_the_connections():
    """At start a worker raises its soft RLIMIT_NOFILE to the hard limit, and its connection
    budget stays below it (run in a child, whose limits the test may lower)."""
    code = (
        "import json, resource\n"
        "from ringserve.api.connections import connection_budget, raise_open_file_limit\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, 300))\n"
        "print(json.dumps([raise_open_file_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0],"
        " connection_budget(0), connection_budget(10)]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    (old, new), soft, budget, capped = json.loads(out.stdout)
    assert (old, new, soft) == (64, 300, 300)
    assert 8 <= budget <= 300 - 64 and capped == 10
