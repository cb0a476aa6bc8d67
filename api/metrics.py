"""`GET /metrics`: Prometheus text rendered with prometheus_client from a stats snapshot.

The numbers come from shared memory — the GPU process's stats region and one region per worker in
the control block — so whichever worker answers, the text is the same. This module only renders:
it takes the regions as plain dicts of named floats (the GPU stats `shm.stats_schema.GPU_STATS`
declares, with their metric names and help; `shm.stats_schema.WORKER_STAT_NAMES`, histogram bucket
arrays as `<hist>_bucket_<i>`, `_sum`, `_count`) and renders every metric of its catalogue (a
missing value reads 0), so the set of series does not depend on which stats happen to be non-zero.

Histograms named `<base>_plen_<label>` in `shm.stats_schema.HISTOGRAMS` (TTFT / TPOT per prompt-length
bucket) are rendered as `ringserve_<base>_by_prompt_len_seconds{prompt_len="<label>"}`.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from ringserve.shm import stats_schema as S
from ringserve.shm.messages import FINISH_REASONS

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass(frozen=True)
class StatsSnapshot:
    """The server's stats at one moment: the GPU region, model facts, and every worker's region."""

    gpu: Mapping[str, float] = field(default_factory=dict)
    workers: Sequence[Mapping[str, float]] = ()
    block_size: int = 0  # from the model facts; 0 while unknown
    attention: Mapping[str, object] = field(default_factory=dict)  # model facts: backend per op, check failures
    started_at: float = 0.0  # Unix time the server started: when its (empty) LoRA state was set


# name, help, key in the worker regions (summed over workers)
_WORKER_GAUGES = (("ringserve_open_streams", "Requests open in the API workers.", "open_streams"),)
_WORKER_COUNTERS = (
    ("ringserve_requests", "Completion requests received.", "requests_total"),
    ("ringserve_prompt_tokens", "Prompt tokens of admitted requests.", "prompt_tokens_total"),
    ("ringserve_completion_tokens", "Tokens sent to clients.", "completion_tokens_total"),
    ("ringserve_disconnects", "Requests cancelled because the client went away.", "disconnects"),
    ("ringserve_slow_reader_cancels", "Requests cancelled because the client stopped reading.", "slow_reader_cancels"),
    (
        "ringserve_requests_refused_at_once",
        "Of the 429s, those a worker answered before reading the body (the key was past the queue limit).",
        "refused_at_once",
    ),
)
_REJECTIONS = (("400", "requests_rejected_400"), ("429", "requests_rejected_429"), ("other", "requests_rejected_other"))
_HIST_HELP = {
    "ttft_ms": "Time to first token, seconds (arrival at the worker to first token).",
    "tpot_ms": "Time per output token after the first, seconds.",
    "max_gap_ms": "Longest gap between two tokens of a request, seconds.",
}


_LORA_STATS = tuple(f"{prefix}_" for prefix, *_ in S.LORA_STATS)
_TENANT_STATS = tuple(f"{prefix}_" for prefix, *_ in S.TENANT_STATS)

# vLLM's request histograms, the series its Grafana dashboards chart: (name, worker histogram,
# what divides the region's value, help). The worker histograms count ms or tokens.
_VLLM_HISTOGRAMS = (
    ("vllm:time_to_first_token_seconds", "ttft_ms", 1000.0, "Time to first token, seconds."),
    ("vllm:time_per_output_token_seconds", "tpot_ms", 1000.0, "Mean time per output token of a request, seconds."),
    (
        "vllm:request_time_per_output_token_seconds",
        "tpot_ms",
        1000.0,
        "Mean time per output token of a request, seconds (vLLM's newer name).",
    ),
    ("vllm:inter_token_latency_seconds", "itl_ms", 1000.0, "Time between two arrivals of a request's tokens, seconds."),
    ("vllm:e2e_request_latency_seconds", "e2e_ms", 1000.0, "Arrival to the last byte of the response, seconds."),
    ("vllm:request_queue_time_seconds", "queue_ms", 1000.0, "Time waiting for a row on the GPU, seconds."),
    ("vllm:request_prefill_time_seconds", "prefill_ms", 1000.0, "First join to first token, seconds."),
    ("vllm:request_decode_time_seconds", "decode_ms", 1000.0, "First token to last token, seconds."),
    ("vllm:request_inference_time_seconds", "inference_ms", 1000.0, "Prefill and decode time, seconds."),
    ("vllm:request_prompt_tokens", "prompt_tokens", 1.0, "Prompt tokens of a request."),
    ("vllm:request_generation_tokens", "generation_tokens", 1.0, "Tokens generated for a request's sample."),
)
_REQUEST_HISTOGRAMS = frozenset(h.name for h in S.REQUEST_HISTOGRAMS)
_HISTS = {h.name: h for h in S.HISTOGRAMS}


class _SnapshotCollector:
    def __init__(
        self,
        snap: StatsSnapshot,
        model_name: str,
        loras: Mapping[int, str] | Sequence[str] = (),
        max_lora: int = 0,
        tenants: Sequence[str] = (),
    ) -> None:
        self.snap = snap
        self.tenants = tuple(tenants)
        self.model_name = model_name
        # stats index -> adapter name (a plain list: its positions)
        self.loras = dict(loras) if isinstance(loras, Mapping) else dict(enumerate(loras))
        self.max_lora = max_lora

    def collect(self) -> Iterator[Metric]:
        gpu = self.snap.gpu
        labelled: dict[str, list[S.GpuStat]] = {}
        for stat in S.GPU_STATS:
            if stat.name.startswith(_LORA_STATS + _TENANT_STATS):
                continue  # by adapter name and by tenant, below (`_loras`, `_tenants`)
            if stat.label is not None:
                labelled.setdefault(stat.metric, []).append(stat)
                continue
            family = GaugeMetricFamily if stat.kind == "gauge" else CounterMetricFamily
            yield family(stat.metric, stat.help, value=float(gpu.get(stat.name, 0.0)))
        for metric, stats in labelled.items():
            yield _labelled(metric, stats, gpu)
        workers = _sum_workers(self.snap.workers)
        for name, doc, key in _WORKER_GAUGES:
            yield GaugeMetricFamily(name, doc, value=workers.get(key, 0.0))
        for name, doc, key in _WORKER_COUNTERS:
            yield CounterMetricFamily(name, doc, value=workers.get(key, 0.0))
        rejected = CounterMetricFamily(
            "ringserve_requests_rejected", "Requests refused, by HTTP status.", labels=["status"]
        )
        for label, key in _REJECTIONS:
            rejected.add_metric([label], workers.get(key, 0.0))
        yield rejected
        spans = CounterMetricFamily(
            "ringserve_trace_spans", "Trace spans exported, failed to export or dropped.", labels=["outcome"]
        )
        for outcome in ("exported", "failed", "dropped"):
            spans.add_metric([outcome], workers.get(f"trace_spans_{outcome}", 0.0))
        yield spans
        waiting = workers.get("trace_spans_accepted", 0.0) - workers.get("trace_spans_sent", 0.0)
        yield GaugeMetricFamily("ringserve_trace_spans_waiting", "Trace spans queued for the exporter.", value=waiting)
        finished = CounterMetricFamily("ringserve_requests_finished", "Samples finished, by reason.", labels=["reason"])
        for reason in FINISH_REASONS:
            finished.add_metric([reason], workers.get(f"finished_{reason}", 0.0))
        yield finished
        yield from _histograms(workers)
        yield from self._attention()
        yield from self._loras(gpu)
        yield from self._tenant_series(gpu)
        yield from self._gateway(gpu)
        yield from self._vllm_requests(gpu, workers)

    def _vllm_requests(self, gpu: Mapping[str, float], workers: Mapping[str, float]) -> Iterator[Metric]:
        """vLLM's request histograms and token counters, labelled `model_name`."""
        model = self.model_name
        for name, hist, scale, doc in _VLLM_HISTOGRAMS:
            family = HistogramMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], *_buckets(workers, _HISTS[hist], scale))
            yield family
        for name, doc, value in (
            ("vllm:prompt_tokens", "Prompt tokens of admitted requests.", workers.get("prompt_tokens_total", 0.0)),
            ("vllm:generation_tokens", "Tokens generated and sent.", workers.get("completion_tokens_total", 0.0)),
            ("vllm:num_preemptions", "Preemptions of running rows.", float(gpu.get("preemptions", 0.0))),
        ):
            counter = CounterMetricFamily(name, doc, labels=["model_name"])
            counter.add_metric([model], value)
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success", "Samples finished, by reason.", labels=["model_name", "finished_reason"]
        )
        for reason in FINISH_REASONS:
            success.add_metric([model, _VLLM_REASON.get(reason, reason)], workers.get(f"finished_{reason}", 0.0))
        yield success

    def _loras(self, gpu: Mapping[str, float]) -> Iterator[Metric]:
        """Rows running and requests waiting per LoRA adapter, by name (`Control.loras` gives each
        one's stats index)."""
        for prefix, kind, metric, doc in S.LORA_STATS:  # by adapter name, not by the schema's index label
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(metric, doc, labels=["lora_name"])
            for i, name in self.loras.items():
                family.add_metric([name], float(gpu.get(f"{prefix}_{i}", 0.0)))
            yield family

    def _tenant_series(self, gpu: Mapping[str, float]) -> Iterator[Metric]:
        """Per tenant, by its hash (`tenant_book.py`): the tenants with a slot, then "other" (every
        tenant without one, and any slot whose name this scrape could not read)."""
        for prefix, kind, metric, doc in S.TENANT_STATS:
            family = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(metric, doc, labels=["tenant"])
            other = float(gpu.get(f"{prefix}_{S.TENANT_SLOTS - 1}", 0.0))
            for i in range(S.TENANT_SLOTS - 1):
                value = float(gpu.get(f"{prefix}_{i}", 0.0))
                if i < len(self.tenants):
                    family.add_metric([self.tenants[i]], value)
                else:
                    other += value
            family.add_metric(["other"], other)
            yield family

    def _attention(self) -> Iterator[Metric]:
        """Which backend serves each attention op (the start-up kernel check's outcome)."""
        ops = self.snap.attention.get("ops")
        info = GaugeMetricFamily(
            "ringserve_attention_backend_info",
            "The attention backend serving each op (1): the kernels, or the reference where their check failed.",
            labels=["op", "backend"],
        )
        for op, backend in ops.items() if isinstance(ops, dict) else ():
            info.add_metric([str(op), str(backend)], 1.0)
        yield info
        failures = self.snap.attention.get("failures")
        yield GaugeMetricFamily(
            "ringserve_attention_check_failures",
            "Attention ops whose start-up kernel check failed (served by the torch reference).",
            value=float(len(failures)) if isinstance(failures, list) else 0.0,
        )

    def _gateway(self, gpu: Mapping[str, float]) -> Iterator[Metric]:
        """The Gateway API Inference Extension's model-server names, vLLM-spelled, each series
        labelled `model_name` as vLLM labels them (its Grafana dashboards filter on it)."""
        model = self.model_name

        def gauge(name: str, doc: str, value: float) -> Metric:
            family = GaugeMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        def counter(name: str, doc: str, value: float) -> Metric:
            family = CounterMetricFamily(name, doc, labels=["model_name"])
            family.add_metric([model], value)
            return family

        yield gauge(
            "vllm:num_requests_waiting", "Requests waiting to be scheduled.", float(gpu.get("queue_depth", 0.0))
        )
        yield gauge("vllm:num_requests_running", "Requests running on the GPU.", float(gpu.get("running_rows", 0.0)))
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage, 0 to 1.", kv_usage(gpu))
        yield gauge(
            "vllm:gpu_cache_usage_perc", "KV-cache usage, 0 to 1 (the name older gateway releases read).", kv_usage(gpu)
        )
        yield counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", float(gpu.get("prefix_cache_queries", 0.0))
        )
        yield counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", float(gpu.get("prefix_cache_hits", 0.0))
        )
        for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            yield counter(
                f"vllm:spec_decode_{name}",
                f"Speculative decoding: {name.replace('_', ' ').removeprefix('num ')}.",
                float(gpu.get(f"spec_decode_{name}", 0.0)),
            )
        yield _labelled(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            [s for s in S.GPU_STATS if s.metric == "ringserve_spec_decode_num_accepted_tokens_per_pos"],
            gpu,
            model,
        )
        info = GaugeMetricFamily(
            "vllm:cache_config_info", "KV-cache configuration.", labels=["model_name", "block_size", "num_gpu_blocks"]
        )
        info.add_metric([model, str(int(self.snap.block_size)), str(int(gpu.get("kv_blocks_total", 0.0)))], 1.0)
        yield info
        # NOTE: the endpoint picker's scrape fails without the LoRA family. Its one series names
        # the adapters with rows running and those with requests waiting (comma-separated, as
        # vLLM writes them; the gateway's LoRA-affinity scorer reads both and max_lora), valued,
        # as the protocol asks, at the Unix time of that state: this scrape's (the server's start
        # when no adapter is served, max_lora "0").
        lora = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters running and waiting, and how many can be resident at once (max_lora).",
            labels=["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
        )
        running = [n for i, n in self.loras.items() if gpu.get(f"lora_running_{i}", 0.0) > 0]
        waiting = [n for i, n in self.loras.items() if gpu.get(f"lora_waiting_{i}", 0.0) > 0]
        when = time.time() if self.loras else self.snap.started_at
        lora.add_metric([model, str(self.max_lora if self.loras else 0), ",".join(running), ",".join(waiting)], when)
        yield lora


def _labelled(metric: str, stats: list[S.GpuStat], gpu: Mapping[str, float], model_name: str | None = None) -> Metric:
    """One family of the GPU stats that share `metric`, a series per label value (and the
    `model_name` label first when given)."""
    first = stats[0]
    lead = [model_name] if model_name is not None else []
    family = (GaugeMetricFamily if first.kind == "gauge" else CounterMetricFamily)(
        metric,
        first.help,
        labels=["model_name"] * len(lead) + [first.label[0]],  # type: ignore[index]
    )
    for stat in stats:
        family.add_metric([*lead, stat.label[1]], float(gpu.get(stat.name, 0.0)))  # type: ignore[index]
    return family


def kv_usage(gpu: Mapping[str, float]) -> float:
    """The share of the KV pool in use, 0 to 1 (cached prefix blocks count as free)."""
    total = float(gpu.get("kv_blocks_total", 0.0))
    free = float(gpu.get("kv_blocks_free", 0.0))
    return min(1.0, max(0.0, 1.0 - free / total)) if total > 0 else 0.0


def _sum_workers(workers: Sequence[Mapping[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for w in workers:
        for k, v in w.items():
            total[k] = total.get(k, 0.0) + float(v)
    return total


_VLLM_REASON = {"cancelled": "abort", "deadline": "abort_deadline"}  # vLLM's stop, length, abort


def _histograms(stats: Mapping[str, float]) -> Iterator[Metric]:
    split: dict[str, HistogramMetricFamily] = {}
    for hist in S.HISTOGRAMS:
        if hist.name in _REQUEST_HISTOGRAMS:
            continue  # under vLLM's names (`_vllm_requests`)
        base, _, label = hist.name.partition("_plen_")
        seconds = base.removesuffix("_ms")
        doc = _HIST_HELP.get(base, f"{base}, seconds.")
        if label:
            fam = split.get(base)
            if fam is None:
                fam = split[base] = HistogramMetricFamily(
                    f"ringserve_{seconds}_by_prompt_len_seconds", f"{doc} By prompt length.", labels=["prompt_len"]
                )
            fam.add_metric([label], *_buckets(stats, hist))
        else:
            fam = HistogramMetricFamily(f"ringserve_{seconds}_seconds", doc)
            fam.add_metric([], *_buckets(stats, hist))
            yield fam
    yield from split.values()


def _buckets(
    stats: Mapping[str, float], hist: S.Histogram, scale: float = 1000.0
) -> tuple[list[tuple[str, float]], float]:
    """Cumulative buckets and the sum, the region's values divided by `scale` (ms to seconds)."""
    bounds = [repr(bound / scale) for bound in hist.bounds] + ["+Inf"]
    return list(zip(bounds, hist.cumulative(stats))), stats.get(f"{hist.name}_sum", 0.0) / scale


def render(
    snap: StatsSnapshot,
    model_name: str = "",
    loras: Mapping[int, str] | Sequence[str] = (),
    max_lora: int = 0,
    tenants: Sequence[str] = (),
) -> bytes:
    """The Prometheus text exposition of `snap`; `model_name` labels the `vllm:` series; `loras`
    names the served adapters by stats index, `max_lora` of them resident at once; `tenants` the
    tenants with a metrics slot, in slot order."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_SnapshotCollector(snap, model_name, loras, max_lora, tenants))
    return generate_latest(registry)


def from_control(control, started_at: float = 0.0) -> StatsSnapshot:
    """Read a snapshot from a `shm.control.Control` block (every region, seqlock-consistent);
    `started_at` is the server's start (`shm.segment.instance_started_at`)."""
    facts = control.model_facts() or {}
    return StatsSnapshot(
        gpu=control.gpu_stats.read(),
        workers=[control.worker_stats(i).read() for i in range(control.n_workers)],
        block_size=int(facts.get("block_size", 0)),
        attention=facts.get("attention") or {},
        started_at=started_at,
    )
