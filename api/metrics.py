"""`GET /metrics`: Prometheus text rendered with prometheus_client from a stats snapshot.

The numbers come from shared memory (the GPU process's stats and one region per worker in the
control block), so whichever worker answers, the text is the same. This module only renders: it
takes the snapshot as plain dicts of named floats and histogram bucket arrays, and renders every
metric of its catalogue (missing values read 0) so the set of series never depends on the data.

Snapshot keys (GPU): queue_depth, queued_gpu_seconds, running_rows, kv_blocks_free,
kv_blocks_total, block_size, preemptions_total, cancelled_tokens_total, rejected_429_total,
finished_<reason>_total for each finish reason, steps_total. Histograms: `ttft_seconds` and
`tpot_seconds`, each a mapping prompt-length bucket label -> `Histogram`. Per worker:
open_streams, requests_total, tokens_streamed_total, disconnects_total, slow_reader_cancels_total,
stop_string_finishes_total, responses_<status>_total.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Mapping, Sequence

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily,
                                    Metric)

from ringserve.shm.messages import FINISH_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class Histogram:
    """Bucket counts as stored in shared memory: per bucket, not cumulative."""

    bounds: tuple[float, ...]  # upper bounds, ascending; +Inf is implicit
    counts: tuple[float, ...]  # len(bounds) + 1, the last one above every bound
    sum: float

    def __post_init__(self) -> None:
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"need {len(self.bounds) + 1} counts for {len(self.bounds)} bounds, "
                             f"got {len(self.counts)}")
        if any(b >= c for b, c in zip(self.bounds, self.bounds[1:])):
            raise ValueError("histogram bounds must ascend")


@dataclass(frozen=True)
class StatsSnapshot:
    gpu: Mapping[str, float] = field(default_factory=dict)
    histograms: Mapping[str, Mapping[str, Histogram]] = field(default_factory=dict)
    workers: Sequence[Mapping[str, float]] = ()


# name, help, source key
_GPU_GAUGES = (
    ("ringserve_queue_depth", "Requests waiting for a row.", "queue_depth"),
    ("ringserve_queued_gpu_seconds", "Estimated GPU seconds of queued work (429 above the limit).",
     "queued_gpu_seconds"),
    ("ringserve_running_rows", "Rows in the running batch.", "running_rows"),
    ("ringserve_kv_blocks_free", "Free KV-cache blocks.", "kv_blocks_free"),
    ("ringserve_kv_blocks_total", "KV-cache blocks in the pool.", "kv_blocks_total"),
)
_GPU_COUNTERS = (
    ("ringserve_preemptions", "Rows preempted when the KV pool ran out.", "preemptions_total"),
    ("ringserve_cancelled_tokens", "Tokens generated for requests later cancelled.",
     "cancelled_tokens_total"),
    ("ringserve_rejected_429", "Requests refused with 429 (queued GPU work over the limit).",
     "rejected_429_total"),
    ("ringserve_steps", "Steps the GPU loop has run.", "steps_total"),
)
_WORKER_GAUGES = (("ringserve_worker_open_streams", "Requests open in the worker.", "open_streams"),)
_WORKER_COUNTERS = (
    ("ringserve_worker_requests", "Completion requests received.", "requests_total"),
    ("ringserve_worker_tokens_streamed", "Tokens sent to clients.", "tokens_streamed_total"),
    ("ringserve_worker_disconnects", "Requests cancelled because the client went away.",
     "disconnects_total"),
    ("ringserve_worker_slow_reader_cancels", "Requests cancelled because the client stopped reading.",
     "slow_reader_cancels_total"),
    ("ringserve_worker_stop_string_finishes", "Samples ended by a stop string.",
     "stop_string_finishes_total"),
)
RESPONSE_STATUSES = (200, 400, 401, 404, 413, 429, 503)
_HISTOGRAMS = (("ttft_seconds", "Time to first token."), ("tpot_seconds", "Time per output token."))


class _SnapshotCollector:
    def __init__(self, snap: StatsSnapshot) -> None:
        self.snap = snap

    def collect(self) -> Iterator[Metric]:
        gpu = self.snap.gpu
        for name, doc, key in _GPU_GAUGES:
            yield GaugeMetricFamily(name, doc, value=float(gpu.get(key, 0.0)))
        for name, doc, key in _GPU_COUNTERS:
            yield CounterMetricFamily(name, doc, value=float(gpu.get(key, 0.0)))
        finished = CounterMetricFamily("ringserve_requests_finished", "Samples finished, by reason.",
                                       labels=["reason"])
        for reason in FINISH_REASONS:
            finished.add_metric([reason], float(gpu.get(f"finished_{reason}_total", 0.0)))
        yield finished
        yield from self._histograms()
        yield from self._workers()
        yield from self._gateway(gpu)

    def _histograms(self) -> Iterator[Metric]:
        for key, doc in _HISTOGRAMS:
            split = self.snap.histograms.get(key, {})
            total = HistogramMetricFamily(f"ringserve_{key}", doc)
            by_len = HistogramMetricFamily(f"ringserve_{key.removesuffix('_seconds')}_by_prompt_len_seconds",
                                           f"{doc} Split by prompt-length bucket.", labels=["prompt_len"])
            merged: Histogram | None = None
            for label, h in split.items():
                by_len.add_metric([label], _cumulative(h), h.sum)
                merged = h if merged is None else _merge(merged, h)
            if merged is not None:
                total.add_metric([], _cumulative(merged), merged.sum)
            yield total
            yield by_len

    def _workers(self) -> Iterator[Metric]:
        workers = self.snap.workers
        for name, doc, key in _WORKER_GAUGES:
            fam = GaugeMetricFamily(name, doc, labels=["worker"])
            for i, w in enumerate(workers):
                fam.add_metric([str(i)], float(w.get(key, 0.0)))
            yield fam
        for name, doc, key in _WORKER_COUNTERS:
            fam = CounterMetricFamily(name, doc, labels=["worker"])
            for i, w in enumerate(workers):
                fam.add_metric([str(i)], float(w.get(key, 0.0)))
            yield fam
        fam = CounterMetricFamily("ringserve_http_responses", "Completion responses, by HTTP status.",
                                  labels=["status"])
        for status in RESPONSE_STATUSES:
            fam.add_metric([str(status)], sum(float(w.get(f"responses_{status}_total", 0.0)) for w in workers))
        yield fam

    @staticmethod
    def _gateway(gpu: Mapping[str, float]) -> Iterator[Metric]:
        """The Gateway API Inference Extension's model-server names, vLLM-spelled."""
        total = float(gpu.get("kv_blocks_total", 0.0))
        free = float(gpu.get("kv_blocks_free", 0.0))
        yield GaugeMetricFamily("vllm:num_requests_waiting", "Requests waiting to be scheduled.",
                                value=float(gpu.get("queue_depth", 0.0)))
        yield GaugeMetricFamily("vllm:num_requests_running", "Requests running on the GPU.",
                                value=float(gpu.get("running_rows", 0.0)))
        yield GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.",
                                value=min(1.0, max(0.0, 1.0 - free / total)) if total > 0 else 0.0)
        info = GaugeMetricFamily("vllm:cache_config_info", "KV-cache configuration.",
                                 labels=["block_size", "num_gpu_blocks"])
        info.add_metric([str(int(gpu.get("block_size", 0))), str(int(total))], 1.0)
        yield info


def _cumulative(h: Histogram) -> list[tuple[str, float]]:
    out, running = [], 0.0
    for bound, count in zip(h.bounds, h.counts):
        running += count
        out.append((repr(float(bound)), running))
    out.append(("+Inf", running + h.counts[-1]))
    return out


def _merge(a: Histogram, b: Histogram) -> Histogram:
    if a.bounds != b.bounds:
        raise ValueError("prompt-length buckets of one histogram must share their bounds")
    return Histogram(a.bounds, tuple(x + y for x, y in zip(a.counts, b.counts)), a.sum + b.sum)


def render(snap: StatsSnapshot) -> bytes:
    """The Prometheus text exposition of `snap`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap))
    return generate_latest(registry)
