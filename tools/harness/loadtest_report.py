"""What `ringserve loadtest` makes of its measurements: per-rate percentiles, goodput, table, plots.

Pure functions over `RequestRecord`s (one per request sent) and the `/metrics` scrapes of a rate,
so they are tested without a server.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ringserve.tools.bench.sched_sim import percentile

PCTS = (50, 95, 99)
GOODPUT_FRACTION = 0.95


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it; times in seconds from the request's send."""

    prompt_tokens: int
    max_tokens: int
    key: str
    status: int = 0  # HTTP status; 0 if the connection failed or the run timed out first
    token_times: list[float] = field(default_factory=list)
    queue_ms: float | None = None  # from the final event's timing
    finish_reason: str | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None and self.finish_reason is not None

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def tpot_s(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def max_gap_s(self) -> float | None:
        t = self.token_times
        return max(b - a for a, b in zip(t, t[1:])) if len(t) > 1 else None

    def meets(self, ttft_target_s: float, tpot_target_s: float) -> bool:
        """Both latency targets met (a one-token answer has no TPOT and meets that target)."""
        if not self.ok or self.ttft_s is None:
            return False
        return self.ttft_s <= ttft_target_s and (self.tpot_s is None or self.tpot_s <= tpot_target_s)


def _pcts(xs: list[float], scale: float = 1e3) -> dict[str, float]:
    return {f"p{q}": scale * percentile(xs, q) for q in PCTS}


def summarize_rate(
    rate: float,
    records: list[RequestRecord],
    *,
    ttft_target_ms: float,
    tpot_target_ms: float,
    wall_s: float,
    before: dict[str, float],
    after: dict[str, float],
    samples: list[dict[str, float]],
) -> dict:
    """One rate's row: latency percentiles (ms), counts, attainment and server-side figures."""
    ok = [r for r in records if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    gap = [r.max_gap_s for r in ok if r.max_gap_s is not None]
    queue = [r.queue_ms / 1e3 for r in ok if r.queue_ms is not None]
    met = sum(r.meets(ttft_target_ms / 1e3, tpot_target_ms / 1e3) for r in records)
    tokens = sum(len(r.token_times) for r in ok)

    def delta(name: str) -> float | None:
        if name in before and name in after:
            return after[name] - before[name]
        return None

    def series(name: str) -> list[float]:
        return [s[name] for s in samples if name in s]

    rows, kv = series("running_rows"), series("kv_usage")
    return {
        "rate": rate,
        "sent": len(records),
        "ok": len(ok),
        "rejected_429": sum(r.status == 429 for r in records),
        "errors": sum(not r.ok and r.status != 429 for r in records),
        "ttft_ms": _pcts(ttft),
        "tpot_ms": _pcts(tpot),
        "max_gap_ms": _pcts(gap),
        "queue_ms": _pcts(queue),
        "attainment": met / len(records) if records else 0.0,
        "output_tok_s": tokens / wall_s if wall_s > 0 else 0.0,
        "wall_s": wall_s,
        "rows_per_step_mean": sum(rows) / len(rows) if rows else None,
        "rows_per_step_max": max(rows, default=None),
        "kv_use_mean": sum(kv) / len(kv) if kv else None,
        "kv_use_max": max(kv, default=None),
        "preemptions": delta("preemptions"),
        "server_429": delta("rejected_429"),
    }


def goodput(rows: list[dict], fraction: float = GOODPUT_FRACTION) -> float | None:
    """Highest rate whose attainment (share of requests meeting both targets) is >= `fraction`."""
    good = [r["rate"] for r in rows if r["attainment"] >= fraction]
    return max(good) if good else None


def _f(x, fmt: str = ".0f") -> str:
    return "—" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def markdown(rows: list[dict], *, ttft_target_ms: float, tpot_target_ms: float) -> str:
    head = (
        "| req/s | sent | ok | 429 | err | TTFT p50/p95/p99 ms | TPOT p50/p95/p99 ms | max gap p50/p95/p99 ms "
        "| queue p50/p95/p99 ms | rows/step mean (max) | KV use max | preempt | tok/s | met both |\n"
        "|---:|---:|---:|---:|---:|---|---|---|---|---|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        trip = lambda d, fmt=".0f": "/".join(_f(d[f"p{q}"], fmt) for q in PCTS)  # noqa: E731
        kv = r["kv_use_max"]
        lines.append(
            f"| {r['rate']:g} | {r['sent']} | {r['ok']} | {r['rejected_429']} | {r['errors']} | {trip(r['ttft_ms'])} "
            f"| {trip(r['tpot_ms'], '.1f')} | {trip(r['max_gap_ms'])} | {trip(r['queue_ms'])} "
            f"| {_f(r['rows_per_step_mean'], '.1f')} ({_f(r['rows_per_step_max'])}) "
            f"| {_f(None if kv is None else 100 * kv, '.0f')}{'' if kv is None else ' %'} "
            f"| {_f(r['preemptions'])} | {r['output_tok_s']:.1f} | {100 * r['attainment']:.0f} % |"
        )
    g = goodput(rows)
    lines.append("")
    lines.append(
        f"Goodput (highest rate with >= {100 * GOODPUT_FRACTION:.0f} % of requests at TTFT <= "
        f"{ttft_target_ms:g} ms and TPOT <= {tpot_target_ms:g} ms): "
        + ("none of the rates" if g is None else f"{g:g} req/s")
    )
    return "\n".join(lines)


def plot(
    rows: list[dict], directory: str, *, ttft_target_ms: float, tpot_target_ms: float, title: str = ""
) -> list[str]:
    """Latency percentiles against rate (one panel per metric) and attainment against rate."""
    import os

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(directory, exist_ok=True)
    rates = [r["rate"] for r in rows]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    panels = (
        ("ttft_ms", "TTFT", ttft_target_ms),
        ("tpot_ms", "TPOT", tpot_target_ms),
        ("max_gap_ms", "longest gap between tokens", None),
        ("queue_ms", "queue wait", None),
    )
    for ax, (key, name, target) in zip(axes.flat, panels):
        for q, style in zip(PCTS, ("-o", "--s", ":^")):
            ax.plot(rates, [r[key][f"p{q}"] for r in rows], style, label=f"p{q}")
        if target is not None:
            ax.axhline(target, color="grey", lw=1, label="target")
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("arrival rate (req/s)")
        ax.set_ylabel("ms")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    latency = os.path.join(directory, "loadtest-latency.png")
    fig.savefig(latency, dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(rates, [100 * r["attainment"] for r in rows], "-o", label="requests meeting both targets")
    ax.axhline(100 * GOODPUT_FRACTION, color="grey", lw=1, label=f"{100 * GOODPUT_FRACTION:.0f} %")
    ax.set_xlabel("arrival rate (req/s)")
    ax.set_ylabel("%")
    ax.set_ylim(0, 105)
    ax.set_title(f"goodput: TTFT <= {ttft_target_ms:g} ms, TPOT <= {tpot_target_ms:g} ms", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    attain = os.path.join(directory, "loadtest-goodput.png")
    fig.savefig(attain, dpi=110)
    plt.close(fig)
    return [latency, attain]
