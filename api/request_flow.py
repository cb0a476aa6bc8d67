"""What every generation route does once its request is validated and tokenized.

`run(request, st, job, output)`: register the request (DELETE, slow-reader watchdog), submit it
(one Submit per prompt of a batch) and wait for admission (a 429 is answered before any SSE
starts), then stream its events or collect one JSON body; stop rows the client no longer needs (stop strings, DELETE, disconnect),
count it into the worker's stats, and release everything whatever happened. The routes differ
only in their `Output`: the SSE encoder, the non-streaming body and the logprobs shape.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import msgspec
from aiohttp import web

from ringserve.api import request_trace
from ringserve.api.availability import gpu_not_ready
from ringserve.api.errors import ApiError, error_object, error_status, error_type
from ringserve.api.generation import Generation
from ringserve.api.gpu_client import GpuClient
from ringserve.api.job_limits import check_response_size
from ringserve.api.logprobs import COMPLETION_LOGPROBS, LogprobFormat
from ringserve.api.protocol import OutputOptions, SamplingFields, check_model, check_sampling
from ringserve.api.registry import OpenRequest
from ringserve.api.request_stream import Inbox, RequestStream
from ringserve.api.sse import Encoder
from ringserve.api.state import (
    LORA,
    REQUEST_ID,
    STATE,
    TENANT,
    ApiState,
    ignored_header,
    note_ignored,
    served_model,
)
from ringserve.shm.messages import CancelReason, SamplingParams, Submit

# Kernel send buffer of a streaming connection. Bounded (the kernel would autotune it to MBs) so a
# client that stops reading fills it within a few hundred tokens and its blocked write starts the
# slow-reader clock; 128 KiB still carries thousands of events per second over a 100 ms RTT.
STREAM_SNDBUF = 128 * 1024

_SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


@dataclass(frozen=True, slots=True)
class Job:
    """A validated, tokenized generation request, as a route hands it to `run`: one Submit per
    prompt (a batch fans out), `n` choices each."""

    prompts: list[list[int]]
    max_tokens: list[int]  # per prompt
    sampling: SamplingParams
    stop: tuple[str, ...]
    n: int
    logprobs: int | None
    stream: bool
    cache_salt: str | None
    prompt_logprobs: int | None = None  # alternatives per prompt token the GPU computes
    show_prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` field on the response
    echo: list[str] | None = None  # per prompt: the text shown before its choices' answers
    score_only: bool = False  # max_tokens 0 with echo: the one generated token is not shown
    pooling: str | None = None  # an embedding: how the GPU pools each prompt (`shm.messages.POOLING_TYPES`)
    options: OutputOptions = OutputOptions()
    include_usage: bool = False
    continuous_usage: bool = False
    request_id: str | None = None  # the body's request_id (an x-request-id header wins)

    @classmethod
    def of(
        cls,
        common: SamplingFields,
        prompts: list[list[int]],
        max_tokens: list[int],
        sampling: SamplingParams,
        logprobs: int | None,
        **route: Any,
    ) -> Job:
        """The job of a request whose shared fields are `common`; `route` holds the route's own
        (prompt logprobs, echo, ...)."""
        return cls(
            prompts=prompts,
            max_tokens=max_tokens,
            sampling=sampling,
            stop=common.stop,
            n=common.n,
            logprobs=logprobs,
            stream=common.stream,
            cache_salt=common.cache_salt,
            options=common.output,
            include_usage=common.include_usage,
            continuous_usage=common.continuous_usage,
            request_id=common.request_id,
            **route,
        )


@dataclass(frozen=True, slots=True)
class Output:
    """A route's response shapes.

    `encoder(request_id, model, created, include_usage)` builds the `sse.Encoder` of a streamed
    request; `body(request_id, model, gen)` is the JSON body of a non-streamed one;
    `finished(request_id, gen)`, when set, is awaited once every sample has finished, before the
    stream's last event or the body is sent (a stored response is findable before its client has it).
    """

    encoder: Callable[[str, str, int, bool], Encoder]
    body: Callable[[str, str, Generation], dict]
    logprob_format: LogprobFormat = COMPLETION_LOGPROBS
    finished: Callable[[str, Generation], Awaitable[None]] | None = None


class _ParsedBody(Protocol):
    @property
    def model(self) -> str | None: ...


Body = TypeVar("Body", bound=_ParsedBody)
T = TypeVar("T")


async def read_request(request: web.Request, parse: Callable[..., Body]) -> tuple[ApiState, Body]:
    """What a route does first: count the request, parse its body (unknown fields ignored and
    named on the response) and check that it names the served model."""
    st = request.app[STATE]
    st.stats.add("requests_total")
    req = parse(
        await request.read(),
        max_tokens_limit=st.config.max_tokens_limit,
        on_ignored=lambda names: note_ignored(request, names),
    )
    base = req.model is None or req.model == st.model_name or req.model in st.model_aliases
    lora = check_model(req.model, st.model_name, st.model_aliases, () if base else st.adapters(request[TENANT]))
    if lora is not None:
        request[LORA] = lora
    return st, req


async def tokenizing(st: ApiState, work: Awaitable[T]) -> T:
    """`work` (a request's tokenization), counting a client that leaves meanwhile as a disconnect."""
    try:
        return await work
    except asyncio.CancelledError:
        st.stats.add("disconnects")
        raise


async def run(request: web.Request, st: ApiState, job: Job, output: Output) -> web.StreamResponse:
    check_sampling(job.sampling, st.codec.vocab_size, st.status.eos_token_ids())
    check_response_size(
        list(map(len, job.prompts)),
        job.max_tokens,
        job.n,
        job.logprobs,
        echo=job.echo is not None,
        prompt_logprobs=job.show_prompt_logprobs,
        limit=st.config.max_response_logprobs,
    )
    request_id = st.registry.new_id(request.headers.get("x-request-id") or job.request_id, request[TENANT])
    request[REQUEST_ID] = request_id  # the error middleware puts it on error responses too
    marks = request_trace.current()
    arrival = marks.arrival if marks is not None else time.time()
    traced = marks is not None and marks.traced
    client = st.client
    inbox = Inbox()
    streams = [client.open_stream(inbox, p, p * job.n) for p in range(len(job.prompts))]
    entry = OpenRequest(request_id, request[TENANT], streams, request.transport, client)
    st.registry.add(entry)
    st.stats.add("open_streams")
    try:
        if marks is not None:
            marks.submitted = time.time()
        await _submit(
            client,
            streams,
            [
                Submit(
                    rid=stream.rid,
                    request_id=request_id,
                    tenant=request[TENANT],
                    prompt_ids=prompt,
                    max_tokens=max_tokens,
                    sampling=job.sampling,
                    arrival_ts=arrival,
                    deadline_ts=arrival + st.config.request_timeout_s,
                    n=job.n,
                    logprobs=job.logprobs,
                    cache_salt=job.cache_salt,
                    prompt_logprobs=job.prompt_logprobs,
                    pooling=job.pooling,
                    lora=request.get(LORA),
                    trace=traced,
                )
                for stream, prompt, max_tokens in zip(streams, job.prompts, job.max_tokens)
            ],
        )
        entry.gen = gen = Generation(
            st.codec,
            n=job.n,
            stop=job.stop,
            prompts=job.prompts,
            arrival=arrival,
            encoder=None,
            logprobs=job.logprobs,
            logprob_format=output.logprob_format,
            options=job.options,
            stop_ids=_stop_ids(st, job.sampling),
            echo=job.echo,
            score_only=job.score_only,
            scored=job.prompt_logprobs is not None,
            continuous_usage=job.continuous_usage,
            show_prompt_logprobs=job.show_prompt_logprobs,
            pooled=job.pooling is not None,
            detail=marks is not None and marks.detail,
        )
        if marks is not None:
            marks.gen = gen
        if job.stream:
            gen.encoder = output.encoder(request_id, served_model(request, st), int(arrival), job.include_usage)
            return await _stream(request, st, entry, gen, output)
        return await _complete(request, st, entry, gen, output)
    except asyncio.CancelledError:
        _count_gone(st, entry)  # the client went away; its handler was cancelled
        raise
    finally:
        entry.cancel_running()
        if entry.gen is not None:
            _record(st, entry.gen)
        for stream in streams:
            client.release(stream)
        st.registry.remove(entry)
        st.stats.add("open_streams", -1)


def _stop_ids(st: ApiState, sampling: SamplingParams) -> frozenset[int]:
    """The tokens that end a sample with `stop` (their text is not shown unless asked)."""
    ids = frozenset(sampling.stop_token_ids)
    return ids if sampling.ignore_eos else ids | st.status.eos_token_ids()


async def _submit(client: GpuClient, streams: list[RequestStream], submits: list[Submit]) -> None:
    """Submit every prompt and wait for their admissions; if one is refused, the others are
    cancelled and the refusal is the answer (a batch is admitted whole or not at all)."""
    if len(streams) == 1:
        await client.submit(streams[0], submits[0])
        return
    answers = await asyncio.gather(*(client.submit(s, m) for s, m in zip(streams, submits)), return_exceptions=True)
    refused = [a for a in answers if isinstance(a, BaseException)]
    if refused:
        for stream, answer in zip(streams, answers):
            if not isinstance(answer, BaseException):
                client.cancel(stream.rid, CancelReason.CANCELLED)
        raise refused[0]


def _headers(request: web.Request, entry: OpenRequest) -> dict[str, str]:
    return {"x-request-id": entry.request_id, **ignored_header(request)}


async def _stream(
    request: web.Request, st: ApiState, entry: OpenRequest, gen: Generation, output: Output
) -> web.StreamResponse:
    encoder = gen.encoder
    if encoder is None:
        raise RuntimeError("a streamed request's generation has its event encoder")
    resp = web.StreamResponse(headers={**_SSE_HEADERS, **_headers(request, entry)})
    sock = request.transport.get_extra_info("socket") if request.transport is not None else None
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, STREAM_SNDBUF)
    loop = asyncio.get_running_loop()
    try:
        await resp.prepare(request)
        entry.farewell = _farewell(encoder, gen, resp.headers.get("Transfer-Encoding") == "chunked")
        opening = encoder.start(len(gen.samples))
        if opening:
            await resp.write(opening)
        while not gen.finished:
            events = gen.consume(await entry.next_batch())
            _cancel_stopped(entry, gen)
            if events:
                entry.write_since = loop.time()
                await resp.write(b"".join(events) if len(events) > 1 else events[0])
                entry.write_since = 0.0
        tail = [encoder.END]
        if gen.error is None:
            await _settle(st, entry, gen)
            if output.finished is not None:
                await output.finished(entry.request_id, gen)
            tail.insert(0, encoder.usage(gen.usage(), gen.timing()))
        entry.write_since = loop.time()
        await resp.write(b"".join(tail))
        await resp.write_eof()
        entry.write_since = 0.0
    except ConnectionError:
        # A write found the connection gone (client left, or the slow-reader watchdog closed it);
        # the caller's finally cancels the rows. Nothing more can be sent.
        _count_gone(st, entry)
    return resp


def _farewell(encoder: Encoder, gen: Generation, chunked: bool) -> Callable[[str, str], bytes]:
    """How this stream ends with an error outside the event loop (`last_words`): an error event
    with the tokens streamed so far, the stream's end ([DONE]), and the end of the chunked body."""

    def bytes_for(code: str, message: str) -> bytes:
        body = error_object(message, code, type_=error_type(code), extra={"tokens_streamed": gen.tokens})
        data = encoder.error(body) + encoder.END
        return b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if chunked else data

    return bytes_for


def _record(st: ApiState, gen: Generation) -> None:
    """Count a finished request into the worker's stats: tokens, finish reasons, latencies."""
    stats = st.stats
    prompt_tokens = gen.prompt_tokens
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
    stats.observe("e2e_ms", (time.time() - gen.arrival) * 1000.0)
    stats.observe("prompt_tokens", prompt_tokens)
    for gap in gen.gaps:
        stats.observe("itl_ms", gap * 1000.0)
    for s in gen.samples:
        f = s.finish
        if f is None:
            continue
        stats.observe("queue_ms", f.queue_ms)
        stats.observe("prefill_ms", f.prefill_ms)
        stats.observe("decode_ms", f.decode_ms)
        stats.observe("inference_ms", f.prefill_ms + f.decode_ms)
        stats.observe("generation_tokens", s.tokens)


def _count_gone(st: ApiState, entry: OpenRequest) -> None:
    if entry.ended_by is CancelReason.SLOW_READER:
        st.stats.add("slow_reader_cancels")
    else:
        entry.ended_by = entry.ended_by or CancelReason.DISCONNECT
        st.stats.add("disconnects")


async def _complete(
    request: web.Request, st: ApiState, entry: OpenRequest, gen: Generation, output: Output
) -> web.Response:
    while not gen.finished:
        gen.consume(await entry.next_batch())
        _cancel_stopped(entry, gen)
    if gen.error is not None:
        err = gen.error_body()["error"]
        extra = {k: v for k, v in err.items() if k not in ("message", "type", "param", "code")}
        status = error_status(err["code"])
        raise ApiError(
            status,
            err["message"],
            code=err["code"],
            type_=err["type"],
            extra=extra,
            retry_after_s=st.status.reload_s() if status == 503 else None,
        )
    await _settle(st, entry, gen)
    if output.finished is not None:
        await output.finished(entry.request_id, gen)
    body = output.body(entry.request_id, served_model(request, st), gen)
    headers = _headers(request, entry)
    if gen.detail:
        headers["Server-Timing"] = request_trace.server_timing(gen.timing())
    return web.Response(body=await _encode(body), content_type="application/json", headers=headers)


ENCODE_SLICE = 2048  # list items encoded between two turns of the event loop
ENCODE_WALK = 64  # a list of at most this many objects is walked into, item by item


async def _encode(value: Any) -> bytes:
    """The JSON of a response body, a slice at a time with the event loop let run between slices:
    a body with logprobs can be tens of MB (`job_limits`), and every other stream of the worker
    waits while the encoder holds the loop. Objects and short lists are walked into; a long list
    is encoded `ENCODE_SLICE` items at a time, a short one of objects (the choices) an item at a time."""
    if isinstance(value, dict):
        return msgspec.json.encode({k: msgspec.Raw(await _encode(v)) for k, v in value.items()})
    if not isinstance(value, list) or not value:
        return msgspec.json.encode(value)
    if len(value) > ENCODE_SLICE:
        parts = []
        for i in range(0, len(value), ENCODE_SLICE):
            parts.append(msgspec.json.encode(value[i : i + ENCODE_SLICE])[1:-1])
            await asyncio.sleep(0)
        return b"[" + b",".join(parts) + b"]"
    if len(value) <= ENCODE_WALK and isinstance(value[0], (dict, list)):  # e.g. the choices
        return b"[" + b",".join([await _encode(v) for v in value]) + b"]"
    return msgspec.json.encode(value)


async def _settle(st: ApiState, entry: OpenRequest, gen: Generation) -> None:
    """Every sample is finished for the client; stop the GPU rows still running (stop strings,
    DELETE) and give their Finish records (timing) a moment to arrive."""
    if gen.gpu_done:
        return
    entry.cancel_running()
    try:
        async with asyncio.timeout(st.finish_grace_s):
            while not gen.gpu_done:
                gen.consume(await entry.next_batch())
    except TimeoutError:
        pass
    if gen.gpu_done:
        return
    # Without the GPU's answer the Cancel stays in force; the finally block must not resend it.
    for s in gen.samples:
        s.gpu_done = True


def _cancel_stopped(entry: OpenRequest, gen: Generation) -> None:
    """A stop string ended a sample while others still run: stop that sample's GPU row now (the
    request's own Cancel covers the last one)."""
    while gen.stopped:
        index = gen.stopped.pop()
        if gen.unfinished and not gen.samples[index].gpu_done:
            entry.cancel_sample(gen, index)


def check_available(st: ApiState) -> None:
    """503 while draining or while the GPU process is not ready (before any work on the request)."""
    if st.draining:
        raise ApiError(
            503,
            "The server is draining for shutdown; retry on another instance.",
            code="server_draining",
            retry_after_s=5.0,
        )
    if not st.status.ready():
        raise gpu_not_ready(st)
