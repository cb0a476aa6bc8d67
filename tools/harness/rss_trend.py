"""Judging a process's memory over a soak: growth that plateaus passes, growth that does not fails.

A serving process's RSS rises while its allocator and caches warm up to the load's working set,
then levels off; a leak keeps rising at a steady rate. So the judgement looks at the second half
of the soak only: the least-squares slope of RSS against time there must stay under
`max_slope_mib_min`, unless the growth it adds over that half is under `floor_mib` (allocator
noise in a short soak). A total-growth limit (first quarter to last quarter) catches a jump that
the slope alone would forgive.

`write_report` saves what the BENCHMARKS page shows: the samples (CSV), one line per process
(PNG, with matplotlib when installed) and a table of RSS at fixed points of the soak (markdown).
"""

from __future__ import annotations

import csv
import statistics
from dataclasses import dataclass
from pathlib import Path

MIB = 1 << 20


@dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str
    slope_mib_min: float | None  # over the second half; None when there were too few samples


def slope_per_min(samples: list[tuple[float, int]]) -> float:
    """Least-squares slope of (seconds, bytes) samples, in MiB per minute."""
    n = len(samples)
    mt = sum(t for t, _ in samples) / n
    mr = sum(r for _, r in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var == 0:
        return 0.0
    cov = sum((t - mt) * (r - mr) for t, r in samples)
    return cov / var * 60 / MIB


def judge(
    samples: list[tuple[float, int]],
    *,
    max_slope_mib_min: float = 0.5,
    floor_mib: float = 16.0,
    max_growth: float = 0.1,
    growth_floor_mib: float = 32.0,
    min_samples: int = 8,
) -> Verdict:
    """Judge one process's (seconds, RSS bytes) samples; see the module docstring."""
    if len(samples) < min_samples:
        return Verdict(True, f"not judged: {len(samples)} samples, {min_samples} needed", None)
    q = len(samples) // 4
    first = statistics.median(r for _, r in samples[:q])
    last = statistics.median(r for _, r in samples[-q:])
    limit = max(first * (1 + max_growth), first + growth_floor_mib * MIB)
    half = samples[len(samples) // 2 :]
    slope = slope_per_min(half)
    added = slope * (half[-1][0] - half[0][0]) / 60
    still_growing = slope > max_slope_mib_min and added > floor_mib
    ok = last <= limit and not still_growing
    detail = (
        f"{first / MIB:.0f} -> {last / MIB:.0f} MiB (limit {limit / MIB:.0f}); second half "
        f"{slope:+.2f} MiB/min ({added:+.1f} MiB){', still growing' if still_growing else ''}"
    )
    return Verdict(ok, detail, slope)


def write_report(out: Path, series: dict[str, list[tuple[float, int]]], verdicts: dict[str, Verdict]) -> list[Path]:
    """CSV of every sample, a PNG of RSS over time (if matplotlib is there) and a markdown table,
    under `out`; the paths written. `series` maps a process label to its samples."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "soak-rss.csv", out / "soak-rss.md"]
    with open(written[0], "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["process", "t_s", "rss_mib"])
        for label, xs in series.items():
            w.writerows((label, f"{t:.1f}", f"{r / MIB:.1f}") for t, r in xs)
    written[1].write_text(_table(series, verdicts))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(8, 4))
    for label, xs in series.items():
        ax.plot([t / 60 for t, _ in xs], [r / MIB for _, r in xs], label=label)
    ax.set_xlabel("minutes of load")
    ax.set_ylabel("RSS (MiB)")
    ax.set_title("ringserve soak: resident memory per process")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "soak-rss.png", dpi=110)
    plt.close(fig)
    return written + [out / "soak-rss.png"]


def _table(series: dict[str, list[tuple[float, int]]], verdicts: dict[str, Verdict]) -> str:
    """RSS (MiB) at 0 %, 25 %, 50 %, 75 % and 100 % of the soak, and the second-half slope."""
    marks = (0.0, 0.25, 0.5, 0.75, 1.0)
    end = max((xs[-1][0] for xs in series.values() if xs), default=0.0)
    digits = 0 if end >= 600 else 1
    head = (
        "| process | "
        + " | ".join(f"{m * end / 60:.{digits}f} min" for m in marks)
        + " | second-half slope | verdict |\n|---|"
        + "---|" * (len(marks) + 2)
        + "\n"
    )
    rows = []
    for label, xs in series.items():
        if not xs:
            continue
        cells = [f"{_at(xs, m * end) / MIB:.0f}" for m in marks]
        v = verdicts.get(label)
        slope = "n/a" if v is None or v.slope_mib_min is None else f"{v.slope_mib_min:+.2f} MiB/min"
        rows.append(f"| {label} | " + " | ".join(cells) + f" | {slope} | {'ok' if v is None or v.ok else 'FAIL'} |")
    return head + "\n".join(rows) + "\n"


def _at(xs: list[tuple[float, int]], t: float) -> int:
    """The sample nearest to time `t`."""
    return min(xs, key=lambda s: abs(s[0] - t))[1]
