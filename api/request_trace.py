"""Where one request's time went: its OpenTelemetry trace, and the breakdown a client may ask for.

A generation request's `Marks` (found through `current()` by whatever runs on its behalf in the
worker) collect the worker's side: arrival, each grammar conversion, when its Submits left. The
GPU process records its side for a traced request (`Submit.trace`: the request is sampled, or its
client sent `x-ringserve-timing: 1`) and sends it back in each sample's `Finish`: the first join,
every prompt (and recompute) chunk with its step's start and end, preemptions and resumes, the
matcher's compile, first token and end (`shm.messages.TIMELINE_KINDS`). Nothing is measured from
the worker's side of the ring that happened on the GPU.

`Tracing` (one per worker, off without `--otlp-traces-endpoint`) exports each sampled request as a
server span, parented on the client's W3C `traceparent` (and `tracestate`), with the GenAI
semantic-convention attributes and these children, which tile it:

    tokenize [arrival, submitted]        worker: parse, template, tokenize; grammar.convert inside
    queue    [submitted, first join]     GPU: waiting for a row; grammar.compile inside
    prefill  [first join, first token]   GPU: prefill.chunk spans, one per step that computed part of it
    decode   [first token, last token]   GPU: preempt / resume events, recompute chunks inside
    respond  [last token, end]           worker: the last events written

(one queue / prefill / decode set per sample, `ringserve.sample` naming it). Spans are built with
their recorded times once the request ends and handed to the SDK's batching processor, whose
thread exports them: the event loop never waits on the collector, and while it is slow or down
spans are dropped rather than queued past `QUEUE_SPANS` (`_Bounded`, which counts them: the
worker's `trace_spans_*` stats, `ringserve_trace_spans_total{outcome}` and
`ringserve_trace_spans_waiting` on /metrics). The tenant appears as its hash
(`auth.tenant_of`); no key, prompt or answer text is ever put on a span.
"""

from __future__ import annotations

import contextvars
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ringserve.api.worker_stats import WorkerStats

log = logging.getLogger(__name__)

TIMING_HEADER = "x-ringserve-timing"  # "1": the response's timing carries the GPU timeline
OPERATIONS = {
    "/v1/completions": "text_completion",
    "/v1/chat/completions": "chat",
    "/v1/responses": "chat",
    "/v1/messages": "chat",
    "/v1/embeddings": "embeddings",
}
# The batching processor: spans wait at most this long, at most this many (then new ones are dropped).
EXPORT_DELAY_MS = 500
QUEUE_SPANS = 4096
EXPORT_BATCH = 512
EXPORT_TIMEOUT_S = 2.0  # one export, its retries included: the processor's thread is never stuck longer


@dataclass(slots=True)
class Marks:
    """One generation request's worker-side times (Unix seconds) and its server span."""

    arrival: float
    detail: bool = False  # the client asked for the GPU timeline in its timing
    span: Any = None  # the server span, when sampled
    submitted: float = 0.0
    grammar: list[tuple[float, float, bool]] = field(default_factory=list)  # (start, end, remembered)
    gen: Any = None  # the request's `Generation`, once it has one

    @property
    def traced(self) -> bool:
        """The GPU process records this request's timeline."""
        return self.span is not None or self.detail


_CURRENT: contextvars.ContextVar[Marks | None] = contextvars.ContextVar("ringserve_request_marks", default=None)


def current() -> Marks | None:
    """The marks of the request the running task serves (None outside a generation request)."""
    return _CURRENT.get()


def note_grammar(start: float, remembered: bool) -> None:
    marks = _CURRENT.get()
    if marks is not None:
        marks.grammar.append((start, time.time(), remembered))


def sample_phases(arrival: float, finish) -> dict[str, float] | None:
    """A sample's GPU phases from its Finish, Unix seconds: join, first_token, last_token (None
    before the first Finish)."""
    if finish is None:
        return None
    join = arrival + finish.queue_ms / 1000.0
    first = arrival + finish.ttft_ms / 1000.0 if finish.ttft_ms else join + finish.prefill_ms / 1000.0
    return {"join": join, "first_token": first, "last_token": first + finish.decode_ms / 1000.0}


def timeline_ms(arrival: float, finish) -> list[dict]:
    """A sample's timeline as the client sees it in `timing.timeline`: ms from arrival."""
    return [
        {"event": kind, "start_ms": round((t0 - arrival) * 1000.0, 3), "end_ms": round((t1 - arrival) * 1000.0, 3)}
        | ({"tokens": n} if kind in ("join", "resume", "chunk", "preempt") else {})
        for kind, t0, t1, n in finish.timeline or ()
    ]


def server_timing(timing: dict) -> str:
    """The `Server-Timing` header (W3C) of a non-streamed response that asked for its timing."""
    parts = [
        f"{name};dur={timing[f'{name}_ms']:.3f}"
        for name in ("queue", "prefill", "decode")
        if timing.get(f"{name}_ms") is not None
    ]
    parts.append(f"preemptions;desc={timing.get('preemptions', 0)}")
    return ", ".join(parts)


class Tracing:
    """A worker's tracer: the aiohttp middleware that opens each generation request's marks (and,
    when tracing is on and the request sampled, its server span) and ends them with the response."""

    def __init__(self, config, model_name: str, worker: int = 0, labels=lambda request: {}, stats=None) -> None:
        self.model_name = model_name
        self.labels = labels  # request -> the span's ringserve.* attributes its handler left on it
        self.tracer = None
        self.provider = None
        if config.otlp_traces_endpoint:
            self.provider, self.tracer = _provider(config, worker, stats if stats is not None else WorkerStats())

    @web.middleware
    async def middleware(self, request: web.Request, handler) -> web.StreamResponse:
        operation = OPERATIONS.get(request.path)
        if operation is None or request.method != "POST":
            return await handler(request)
        marks = Marks(time.time(), detail=request.headers.get(TIMING_HEADER, "").strip().lower() in ("1", "true"))
        if self.tracer is not None:
            marks.span = self._start(request, operation, marks.arrival)
        token = _CURRENT.set(marks)
        status = 500
        try:
            resp = await handler(request)
            status = resp.status
            return resp
        except web.HTTPException as exc:
            status = exc.status
            raise
        except BaseException:
            status = 499  # the client left (the handler was cancelled) or the worker failed
            raise
        finally:
            _CURRENT.reset(token)
            if marks.span is not None:
                try:
                    self._end(request, marks, status)
                except Exception:  # noqa: BLE001 - a trace must never fail a request
                    log.exception("a request's trace could not be recorded")

    # -- spans ----------------------------------------------------------------------------------

    def _start(self, request: web.Request, operation: str, arrival: float):
        from opentelemetry import propagate
        from opentelemetry.trace import SpanKind

        parent = propagate.extract(request.headers)
        span = self.tracer.start_span(  # type: ignore[union-attr]
            f"{operation} {self.model_name}",
            context=parent,
            kind=SpanKind.SERVER,
            start_time=_ns(arrival),
            attributes={
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "ringserve",
                "gen_ai.request.model": self.model_name,
                "http.request.method": request.method,
                "url.path": request.path,
            },
        )
        return span if span.is_recording() else None

    def _end(self, request: web.Request, marks: Marks, status: int) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        span, end = marks.span, time.time()
        span.set_attribute("http.response.status_code", status)
        labels = self.labels(request)
        span.set_attributes(labels)
        if status >= 500 or status == 499:
            span.set_status(Status(StatusCode.ERROR))
        ctx = trace.set_span_in_context(span)
        gen = marks.gen
        submitted = marks.submitted or end
        tokenize = self._child("tokenize", ctx, marks.arrival, submitted)
        for start, stop, remembered in marks.grammar:
            self._child(
                "grammar.convert",
                trace.set_span_in_context(tokenize),
                start,
                stop,
                {"ringserve.remembered": remembered},
            ).end(_ns(stop))
        tokenize.end(_ns(submitted))
        if gen is not None:
            usage = gen.usage()
            span.set_attribute("gen_ai.usage.input_tokens", usage["prompt_tokens"])
            span.set_attribute("gen_ai.usage.output_tokens", usage["completion_tokens"])
            span.set_attribute("gen_ai.response.finish_reasons", [s.reason or "error" for s in gen.samples])
            span.set_attribute("gen_ai.response.model", labels.get("ringserve.lora_adapter") or self.model_name)
            last = submitted
            for i, s in enumerate(gen.samples):
                last = max(last, self._sample(ctx, span, i, submitted, gen.arrival, s.finish))
            self._child("respond", ctx, last, end).end(_ns(end))
        span.end(_ns(end))

    def _sample(self, ctx, server, index: int, submitted: float, arrival: float, finish) -> float:
        """The queue, prefill and decode spans of one sample; when its last token came."""
        from opentelemetry import trace

        phases = sample_phases(arrival, finish)
        if phases is None:
            return submitted
        attrs = {"ringserve.sample": index}
        events = finish.timeline or []
        queue = self._child("queue", ctx, submitted, phases["join"], attrs)
        for kind, t0, t1, _ in events:
            if kind == "grammar":
                self._child("grammar.compile", trace.set_span_in_context(queue), t0, t1, attrs).end(_ns(t1))
        queue.end(_ns(phases["join"]))
        computed = next((n for kind, _, _, n in events if kind == "join"), finish.prompt_tokens)
        prefill = self._child(
            "prefill",
            ctx,
            phases["join"],
            phases["first_token"],
            attrs
            | {
                "gen_ai.usage.input_tokens": finish.prompt_tokens,
                "ringserve.cached_tokens": finish.prompt_tokens - computed,
            },
        )
        decode = self._child(
            "decode",
            ctx,
            phases["first_token"],
            phases["last_token"],
            attrs
            | {"gen_ai.usage.output_tokens": finish.completion_tokens, "ringserve.preemptions": finish.preemptions},
        )
        server.add_event("first_token", {"ringserve.sample": index}, timestamp=_ns(phases["first_token"]))
        for kind, t0, t1, n in events:
            before_first = t1 <= phases["first_token"] + 1e-6
            parent = prefill if before_first else decode
            if kind == "chunk":
                name = "prefill.chunk" if before_first else "recompute.chunk"
                self._child(name, trace.set_span_in_context(parent), t0, t1, attrs | {"ringserve.tokens": n}).end(
                    _ns(t1)
                )
            elif kind in ("preempt", "resume"):
                decode.add_event(kind if kind == "preempt" else "resume", {"ringserve.tokens": n}, timestamp=_ns(t0))
        prefill.end(_ns(phases["first_token"]))
        decode.end(_ns(phases["last_token"]))
        return phases["last_token"]

    def _child(self, name: str, ctx, start: float, end: float, attrs: dict | None = None):
        return self.tracer.start_span(f"ringserve.{name}", context=ctx, start_time=_ns(start), attributes=attrs)  # type: ignore[union-attr]

    async def close(self) -> None:
        """Export what is queued (bounded by the export timeout), then stop the processor."""
        if self.provider is not None:
            provider, self.provider = self.provider, None
            import asyncio

            await asyncio.get_running_loop().run_in_executor(None, provider.shutdown)


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class _Bounded(SpanProcessor):
    """The span processor in front of the SDK's batching one: it hands a span on only while fewer
    than `QUEUE_SPANS` wait for the exporter, and counts the rest as dropped. The batching
    processor's own queue is a batch larger, so it never drops one uncounted. A span's path is
    counted in the worker's stats: `trace_spans_accepted` here (the event loop), then
    `trace_spans_sent` to the exporter and `…_exported` or `…_failed` (the exporter's thread,
    which writes only those)."""

    def __init__(self, inner, stats) -> None:
        self.inner, self.stats = inner, stats

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span) -> None:
        v = self.stats.values
        # NOTE: a batch the exporter has taken but not yet counted still reads as waiting, so this
        # drops a little early, never late
        if v["trace_spans_accepted"] - v["trace_spans_sent"] >= QUEUE_SPANS:
            v["trace_spans_dropped"] += 1
            return
        v["trace_spans_accepted"] += 1
        self.inner.on_end(span)

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


class _Counted(SpanExporter):
    """An exporter that counts what it was given and how each export ended."""

    def __init__(self, inner, stats) -> None:
        self.inner, self.stats = inner, stats

    def export(self, spans):
        v = self.stats.values
        v["trace_spans_sent"] += len(spans)
        result = self.inner.export(spans)
        v["trace_spans_exported" if result == SpanExportResult.SUCCESS else "trace_spans_failed"] += len(spans)
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.inner.force_flush(timeout_millis)


def _provider(config, worker: int, stats: WorkerStats):
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    endpoint = config.otlp_traces_endpoint
    exporter: SpanExporter
    if config.otlp_traces_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        # plaintext unless https:// (a bare host:4317 is how collectors listen by default)
        secure = endpoint.startswith("https://")
        exporter = GrpcExporter(endpoint=endpoint, insecure=not secure, timeout=EXPORT_TIMEOUT_S)
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        url = endpoint if endpoint.rstrip("/").endswith("/v1/traces") else endpoint.rstrip("/") + "/v1/traces"
        exporter = OTLPSpanExporter(endpoint=url, timeout=EXPORT_TIMEOUT_S)
    resource = Resource.create({"service.name": "ringserve", "service.instance.id": f"worker-{worker}"})
    provider = TracerProvider(
        resource=resource, sampler=ParentBased(root=TraceIdRatioBased(config.otlp_traces_sample_rate))
    )
    batching = BatchSpanProcessor(
        _Counted(exporter, stats),
        max_queue_size=QUEUE_SPANS + EXPORT_BATCH,
        schedule_delay_millis=EXPORT_DELAY_MS,
        max_export_batch_size=EXPORT_BATCH,
        export_timeout_millis=int(EXPORT_TIMEOUT_S * 1000),
    )
    provider.add_span_processor(_Bounded(batching, stats))
    return provider, provider.get_tracer("ringserve")
