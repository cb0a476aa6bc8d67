"""The ORCA load report a replica sends on every generation response (`endpoint-load-metrics`).

A proxy in front of several replicas (Envoy's client-side weighted round robin,
docs/design.md#fleet) weighs each one by `rps_fractional / (application_utilization +
eps / rps_fractional × penalty)`. The report is read from the same shared-memory stats as
`/metrics`, so it is the whole replica's load whichever worker answers:

* `application_utilization`: the busier of the KV pool's use and the share of rows running,
  plus the queued GPU work as a share of the admission limit (a full batch with a queue behind it
  is busier than a full batch alone); at least `MIN_UTILIZATION`, so a replica that serves
  traffic always has a weight;
* `rps_fractional` and `eps`: completion requests and 429 refusals per second over the last
  `RATE_WINDOW_S`, from the workers' counters;
* `named_metrics.*`: the inputs, for a proxy that weighs them itself (KV use, queued GPU
  seconds, running rows, waiting requests).

ORCA's text form (`TEXT k=v, k=v`) is what Envoy parses from this header. The snapshot is read at
most every `REFRESH_S`: a header costs a dict lookup, not a read of every stats region.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

from ringserve.api.metrics import StatsSnapshot, kv_usage

HEADER = "endpoint-load-metrics"
REFRESH_S = 0.1
RATE_WINDOW_S = 5.0
MIN_UTILIZATION = 0.01


class LoadReport:
    """`header()` is the current report, rebuilt from `source()` at most every REFRESH_S."""

    def __init__(
        self,
        source: Callable[[], StatsSnapshot],
        *,
        max_rows: int,
        queue_limit_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.source = source
        self.max_rows = max_rows
        self.queue_limit_s = queue_limit_s
        self.clock = clock
        self._samples: deque[tuple[float, float, float]] = deque()  # (t, requests, 429s)
        self._value = ""
        self._at = float("-inf")

    def header(self) -> str:
        now = self.clock()
        if now - self._at >= REFRESH_S:
            self._value = self._build(now, self.source())
            self._at = now
        return self._value

    def _build(self, now: float, snap: StatsSnapshot) -> str:
        gpu = snap.gpu
        requests = sum(float(w.get("requests_total", 0.0)) for w in snap.workers)
        refused = sum(float(w.get("requests_rejected_429", 0.0)) for w in snap.workers)
        rps, eps = self._rates(now, requests, refused)
        kv = kv_usage(gpu)
        rows = float(gpu.get("running_rows", 0.0))
        queued_s = float(gpu.get("queued_gpu_seconds", 0.0))
        utilization = max(kv, rows / self.max_rows) + queued_s / self.queue_limit_s
        fields = {
            "application_utilization": max(MIN_UTILIZATION, utilization),
            "rps_fractional": rps,
            "eps": eps,
            "named_metrics.kv_cache_usage": kv,
            "named_metrics.queued_gpu_seconds": queued_s,
            "named_metrics.running_rows": rows,
            "named_metrics.waiting_requests": float(gpu.get("queue_depth", 0.0)),
        }
        return "TEXT " + ", ".join(f"{k}={max(0.0, v):.4g}" for k, v in fields.items())

    def _rates(self, now: float, requests: float, refused: float) -> tuple[float, float]:
        """Requests and refusals per second since the oldest sample within RATE_WINDOW_S."""
        samples = self._samples
        samples.append((now, requests, refused))
        while len(samples) > 2 and now - samples[1][0] >= RATE_WINDOW_S:
            samples.popleft()
        t0, r0, x0 = samples[0]
        span = now - t0
        if span <= 0:
            return 0.0, 0.0
        return (requests - r0) / span, (refused - x0) / span
