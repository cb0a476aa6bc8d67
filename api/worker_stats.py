"""One worker's own counters; the worker copies them into its control-block stats region."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class WorkerStats:
    open_streams: int = 0
    requests_total: int = 0
    tokens_streamed_total: int = 0
    disconnects_total: int = 0
    slow_reader_cancels_total: int = 0
    stop_string_finishes_total: int = 0
    responses: dict[int, int] = field(default_factory=dict)

    def count_response(self, status: int) -> None:
        self.responses[status] = self.responses.get(status, 0) + 1

    def as_dict(self) -> dict[str, float]:
        """Named floats, the shape `api.metrics` renders and the control block stores."""
        out = {name: float(getattr(self, name)) for name in (
            "open_streams", "requests_total", "tokens_streamed_total", "disconnects_total",
            "slow_reader_cancels_total", "stop_string_finishes_total")}
        out.update({f"responses_{status}_total": float(n) for status, n in self.responses.items()})
        return out
