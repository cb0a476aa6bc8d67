"""One worker's own counters and latency histograms, named as in the control block's worker region.

The worker counts here on its event loop (no shared-memory writes on the hot path) and publishes
the whole set into its seqlocked region periodically, so any worker's /metrics can sum them.
"""

from __future__ import annotations

from ringserve.shm import stats_schema as S
from ringserve.shm.messages import FINISH_REASONS

_HISTS = {h.name: h for h in S.HISTOGRAMS}
# Prompt-length buckets for the split latency histograms: (label, upper bound in tokens). A split
# histogram is observed only where the layout defines `<hist>_plen_<label>`.
PROMPT_LEN_BUCKETS = tuple(zip(S.PROMPT_LEN_LABELS, (*S.PROMPT_LEN_BOUNDS, 1 << 62)))


def prompt_len_label(prompt_tokens: int) -> str:
    for label, bound in PROMPT_LEN_BUCKETS:
        if prompt_tokens <= bound:
            return label
    return PROMPT_LEN_BUCKETS[-1][0]


class WorkerStats:
    """Named floats (`shm.stats_schema.WORKER_STAT_NAMES`) with the StatsRegion writer's verbs."""

    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[str, float] = dict.fromkeys(S.WORKER_STAT_NAMES, 0.0)

    def add(self, name: str, value: float = 1.0) -> None:
        self.values[name] += value

    def get(self, name: str) -> float:
        return self.values[name]

    def observe(self, hist_name: str, value: float, prompt_tokens: int | None = None) -> None:
        """Count `value` into the named histogram (bucket, sum and count), and into its
        prompt-length split when `prompt_tokens` is given and the layout has one."""
        if prompt_tokens is not None:
            split = f"{hist_name}_plen_{prompt_len_label(prompt_tokens)}"
            if split in _HISTS:
                self.observe(split, value)
        v = self.values
        v[_HISTS[hist_name].bucket_name(value)] += 1
        v[f"{hist_name}_sum"] += value
        v[f"{hist_name}_count"] += 1

    def count_rejection(self, status: int) -> None:
        name = f"requests_rejected_{status}"
        self.add(name if name in self.values else "requests_rejected_other")

    def count_finish(self, reason: str) -> None:
        if reason in FINISH_REASONS:
            self.add(f"finished_{reason}")

    def as_dict(self) -> dict[str, float]:
        return dict(self.values)

    def publish(self, region) -> None:
        """Copy everything into a `shm.control.StatsRegion` and make it visible as one snapshot."""
        region.update(self.values)
        region.publish()
