"""What every generation route does once its request is validated and tokenized.

`run(request, st, job, output)`: register the request (DELETE, slow-reader watchdog), submit it
and wait for admission (a 429 is answered before any SSE starts), then stream its events or
collect one JSON body; stop rows the client no longer needs (stop strings, DELETE, disconnect),
count it into the worker's stats, and release everything whatever happened. The routes differ
only in their `Output`: the SSE encoder, the non-streaming body and the logprobs shape.
"""

from __future__ import annotations

import asyncio
import socket
import time
from dataclasses import dataclass
from typing import Callable

import msgspec
from aiohttp import web

from ringserve.api.availability import gpu_not_ready
from ringserve.api.errors import ApiError
from ringserve.api.generation import COMPLETION_LOGPROBS, Generation, LogprobFormat
from ringserve.api.registry import OpenRequest
from ringserve.api.sse import DONE, Encoder
from ringserve.api.state import REQUEST_ID, TENANT, ApiState
from ringserve.shm.messages import SamplingParams, Submit

# Kernel send buffer of a streaming connection. Bounded (the kernel would autotune it to MBs) so a
# client that stops reading fills it within a few hundred tokens and its blocked write starts the
# slow-reader clock; 128 KiB still carries thousands of events per second over a 100 ms RTT.
STREAM_SNDBUF = 128 * 1024

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class Job:
    """A validated, tokenized generation request, as a route hands it to `run`."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    logprobs: int | None
    stream: bool
    cache_salt: str | None


@dataclass(frozen=True, slots=True)
class Output:
    """A route's response shapes.

    `encoder(request_id, model, created, timing)` builds the `sse.Encoder` of a streamed request
    (`timing()` is the request's timing so far); `body(request_id, model, gen)` is the JSON body
    of a non-streamed one.
    """

    encoder: Callable[[str, str, int, Callable[[], dict]], Encoder]
    body: Callable[[str, str, Generation], dict]
    logprob_format: LogprobFormat = COMPLETION_LOGPROBS


async def run(request: web.Request, st: ApiState, job: Job, output: Output) -> web.StreamResponse:
    request_id = st.registry.new_id(request.headers.get("x-request-id"), request[TENANT])
    request[REQUEST_ID] = request_id  # the error middleware puts it on error responses too
    arrival = time.time()
    client = st.client
    stream = client.open_stream()
    entry = OpenRequest(request_id, request[TENANT], stream, request.transport)
    st.registry.add(entry)
    st.stats.add("open_streams")
    gen: Generation | None = None
    try:
        await client.submit(stream, Submit(
            rid=stream.rid, request_id=request_id, tenant=request[TENANT], prompt_ids=job.prompt_ids,
            max_tokens=job.max_tokens, sampling=job.sampling, arrival_ts=arrival,
            deadline_ts=arrival + st.config.request_timeout_s, n=job.n, logprobs=job.logprobs,
            cache_salt=job.cache_salt))
        gen = Generation(st.codec, n=job.n, stop=job.stop, prompt_tokens=len(job.prompt_ids),
                         arrival=arrival, encoder=None, logprobs=job.logprobs,
                         logprob_format=output.logprob_format)
        if job.stream:
            gen.encoder = output.encoder(request_id, st.model_name, int(arrival), gen.timing)
            return await _stream(request, st, entry, gen)
        return await _complete(st, entry, gen, output)
    except asyncio.CancelledError:
        _count_gone(st, entry)  # the client went away; its handler was cancelled
        raise
    finally:
        if gen is not None:
            if not gen.gpu_done:
                client.cancel(stream.rid, _cancel_reason(entry, gen))
            _record(st, gen, len(job.prompt_ids))
        client.release(stream)
        st.registry.remove(entry)
        st.stats.add("open_streams", -1)


async def _stream(request: web.Request, st: ApiState, entry: OpenRequest,
                  gen: Generation) -> web.StreamResponse:
    encoder = gen.encoder
    resp = web.StreamResponse(headers={**_SSE_HEADERS, "x-request-id": entry.request_id})
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
    loop = asyncio.get_running_loop()
    stream = entry.stream
    try:
        await resp.prepare(request)
        opening = encoder.start(len(gen.samples))
        if opening:
            await resp.write(opening)
        while not gen.finished:
            events = gen.consume(await stream.next_batch())
            _cancel_stopped(st, entry, gen)
            if events:
                entry.write_since = loop.time()
                await resp.write(b"".join(events) if len(events) > 1 else events[0])
                entry.write_since = 0.0
        tail = [DONE]
        if gen.error is None:
            await _settle(st, entry, gen)
            tail.insert(0, encoder.usage(gen.usage(), gen.timing()))
        entry.write_since = loop.time()
        await resp.write(b"".join(tail))
        await resp.write_eof()
        entry.write_since = 0.0
    except ConnectionError:
        # A write found the connection gone (client left, or the slow-reader watchdog closed it);
        # the caller's finally cancels the row. Nothing more can be sent.
        _count_gone(st, entry)
    return resp


def _record(st: ApiState, gen: Generation, prompt_tokens: int) -> None:
    """Count a finished request into the worker's stats: tokens, finish reasons, latencies."""
    stats = st.stats
    stats.add("prompt_tokens_total", prompt_tokens)
    stats.add("completion_tokens_total", gen.tokens)
    for s in gen.samples:
        stats.count_finish(s.reason if s.reason is not None else "error" if gen.error else "cancelled")
    if gen.worker_ttft_ms is not None:
        stats.observe("ttft_ms", gen.worker_ttft_ms, prompt_tokens)
        stats.observe("max_gap_ms", gen.max_gap_s * 1000.0)
    tpot = gen.tpot_ms()
    if tpot is not None:
        stats.observe("tpot_ms", tpot, prompt_tokens)


def _count_gone(st: ApiState, entry: OpenRequest) -> None:
    if entry.ended_by == "slow_reader":
        st.stats.add("slow_reader_cancels")
    else:
        entry.ended_by = entry.ended_by or "disconnect"
        st.stats.add("disconnects")


async def _complete(st: ApiState, entry: OpenRequest, gen: Generation, output: Output) -> web.Response:
    stream = entry.stream
    while not gen.finished:
        gen.consume(await stream.next_batch())
        _cancel_stopped(st, entry, gen)
    if gen.error is not None:
        err = gen.error_body()["error"]
        extra = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
        raise ApiError(503, err["message"], code=err["code"], type_=err["type"], extra=extra,
                       retry_after_s=st.reload_s())
    await _settle(st, entry, gen)
    body = output.body(entry.request_id, st.model_name, gen)
    return web.Response(body=msgspec.json.encode(body), content_type="application/json",
                        headers={"x-request-id": entry.request_id})


async def _settle(st: ApiState, entry: OpenRequest, gen: Generation) -> None:
    """Every sample is finished for the client; stop the GPU rows still running (stop strings,
    DELETE) and give their Finish records (timing) a moment to arrive."""
    if gen.gpu_done:
        return
    st.client.cancel(entry.stream.rid, _cancel_reason(entry, gen))
    try:
        async with asyncio.timeout(st.finish_grace_s):
            while not gen.gpu_done:
                gen.consume(await entry.stream.next_batch())
    except TimeoutError:
        pass
    if gen.gpu_done:
        return
    # Without the GPU's answer the Cancel stays in force; the finally block must not resend it.
    for s in gen.samples:
        s.gpu_done = True


def _cancel_stopped(st: ApiState, entry: OpenRequest, gen: Generation) -> None:
    """A stop string ended a sample while others still run: stop that sample's GPU row now (the
    request's own Cancel covers the last one)."""
    while gen.stopped:
        index = gen.stopped.pop()
        if gen.unfinished and not gen.samples[index].gpu_done:
            st.client.cancel(entry.stream.rid, "stop", index=index)


def _cancel_reason(entry: OpenRequest, gen: Generation) -> str:
    if entry.ended_by in ("slow_reader", "disconnect"):
        return entry.ended_by
    if entry.ended_by is not None:
        return "cancelled"
    if gen.unfinished == 0:
        return "stop"
    return "disconnect"


def check_available(st: ApiState) -> None:
    """503 while draining or while the GPU process is not ready (before any work on the request)."""
    if st.draining:
        raise ApiError(503, "The server is draining for shutdown; retry on another instance.",
                       code="server_draining", retry_after_s=5.0)
    if not st.ready():
        raise gpu_not_ready(st)
