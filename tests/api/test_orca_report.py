"""The ORCA load report (`endpoint-load-metrics`): its values from the stats, its rates, and that
generation responses carry it."""

from __future__ import annotations

import pytest

from ringserve.api.metrics import StatsSnapshot
from ringserve.api.orca_report import HEADER, MIN_UTILIZATION, REFRESH_S, LoadReport


def _parse(header: str) -> dict[str, float]:
    fmt, _, body = header.partition(" ")
    assert fmt == "TEXT"
    return {k: float(v) for k, v in (item.strip().split("=") for item in body.split(","))}


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_utilization_is_the_busier_of_kv_and_rows_plus_the_queue():
    """Rows 16 of 32 (0.5) beat KV use 0.25; 1 s queued of a 2 s limit adds 0.5."""
    snap = StatsSnapshot(
        gpu={"running_rows": 16, "kv_blocks_free": 75, "kv_blocks_total": 100, "queued_gpu_seconds": 1.0}
    )
    report = _parse(LoadReport(lambda: snap, max_rows=32, queue_limit_s=2.0).header())
    assert report["application_utilization"] == pytest.approx(1.0)
    assert report["named_metrics.kv_cache_usage"] == pytest.approx(0.25)
    assert report["named_metrics.running_rows"] == 16
    assert report["named_metrics.queued_gpu_seconds"] == 1.0


def test_an_idle_replica_still_reports_a_utilization():
    """Envoy ignores a report whose utilization is 0; an idle replica reports the floor."""
    report = _parse(LoadReport(StatsSnapshot, max_rows=32, queue_limit_s=2.0).header())
    assert report["application_utilization"] == MIN_UTILIZATION


def test_rates_come_from_the_workers_counters_over_the_window():
    """rps_fractional and eps are the requests and 429s per second summed over every worker."""
    clock = _Clock()
    counts = {"requests_total": 0.0, "requests_rejected_429": 0.0}

    def snap() -> StatsSnapshot:
        return StatsSnapshot(workers=[dict(counts), dict(counts)])  # two workers, same counts

    report = LoadReport(snap, max_rows=32, queue_limit_s=2.0, clock=clock)
    assert _parse(report.header())["rps_fractional"] == 0
    counts.update(requests_total=10.0, requests_rejected_429=2.0)
    clock.t += 2.0
    first = _parse(report.header())
    assert first["rps_fractional"] == pytest.approx(10.0)  # 2 workers x 10 requests in 2 s
    assert first["eps"] == pytest.approx(2.0)


def test_the_report_is_rebuilt_at_most_every_refresh_period():
    clock = _Clock()
    reads = []

    def snap() -> StatsSnapshot:
        reads.append(clock.t)
        return StatsSnapshot()

    report = LoadReport(snap, max_rows=32, queue_limit_s=2.0, clock=clock)
    report.header()
    clock.t += REFRESH_S / 2
    report.header()
    clock.t += REFRESH_S
    report.header()
    assert len(reads) == 2


@pytest.mark.asyncio
async def test_generation_responses_carry_the_report_and_other_routes_do_not(serve):
    """Completions (streamed, plain and refused) carry the header; /metrics and /ready do not."""
    served = await serve()
    client = served.client
    streamed = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "stream": True})
    await streamed.read()
    plain = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
    refused = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": -1})
    assert refused.status == 400
    for resp in (streamed, plain, refused):
        assert _parse(resp.headers[HEADER])["application_utilization"] >= MIN_UTILIZATION
    for path in ("/metrics", "/ready"):
        assert HEADER not in (await client.get(path)).headers
