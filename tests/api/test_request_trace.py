"""The export path's bound and counters (api/request_trace.py) on the real SDK: a stuck collector
holds at most `QUEUE_SPANS` spans in the worker and every other one is counted as dropped; what
is accepted is exported once the collector answers, and a failed export is counted as failed."""

from __future__ import annotations

import threading

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from ringserve.api.request_trace import EXPORT_BATCH, QUEUE_SPANS, _Bounded, _Counted
from ringserve.api.worker_stats import WorkerStats


class Collector(SpanExporter):
    """Answers each export once `go` is set (a collector that is slow until then), with `result`."""

    def __init__(self, result=SpanExportResult.SUCCESS) -> None:
        self.go, self.result, self.got = threading.Event(), result, 0
        self.first = threading.Event()

    def export(self, spans):
        self.first.set()
        self.go.wait(30)
        self.got += len(spans)
        return self.result

    def shutdown(self) -> None:
        self.go.set()


def _tracer(collector: Collector, stats: WorkerStats):
    batching = BatchSpanProcessor(
        _Counted(collector, stats), max_queue_size=QUEUE_SPANS + EXPORT_BATCH, max_export_batch_size=EXPORT_BATCH
    )
    provider = TracerProvider()
    provider.add_span_processor(_Bounded(batching, stats))
    return provider, provider.get_tracer("test")


def test_a_stuck_collector_holds_at_most_the_queue_and_every_other_span_is_counted_dropped():
    stats, collector = WorkerStats(), Collector()
    provider, tracer = _tracer(collector, stats)
    for _ in range(EXPORT_BATCH):  # a full batch wakes the processor's thread
        tracer.start_span("s").end()
    assert collector.first.wait(10)  # the exporter holds one batch and is stuck on it
    made = EXPORT_BATCH + 2 * QUEUE_SPANS
    for _ in range(made - EXPORT_BATCH):
        tracer.start_span("s").end()
    v = stats.values
    assert v["trace_spans_accepted"] - v["trace_spans_sent"] <= QUEUE_SPANS  # what waits in the worker
    assert v["trace_spans_accepted"] + v["trace_spans_dropped"] == made  # every span accounted for
    assert v["trace_spans_dropped"] >= QUEUE_SPANS - EXPORT_BATCH
    collector.go.set()  # the collector answers again: everything accepted goes out
    assert provider.force_flush(30_000)
    assert v["trace_spans_exported"] == v["trace_spans_sent"] == v["trace_spans_accepted"] == collector.got
    assert v["trace_spans_failed"] == 0
    provider.shutdown()


def test_a_failed_export_is_counted_failed():
    stats, collector = WorkerStats(), Collector(SpanExportResult.FAILURE)
    collector.go.set()
    provider, tracer = _tracer(collector, stats)
    for _ in range(10):
        tracer.start_span("s").end()
    provider.force_flush(10_000)
    v = stats.values
    assert v["trace_spans_failed"] == v["trace_spans_sent"] == 10 and v["trace_spans_exported"] == 0
    provider.shutdown()
