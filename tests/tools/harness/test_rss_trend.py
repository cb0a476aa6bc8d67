"""The soak's memory judgement: growth that levels off passes, growth that keeps going fails."""

from __future__ import annotations

import math

from ringserve.tools.harness.rss_trend import MIB, judge, write_report


def _series(minutes: float, rss_mib) -> list[tuple[float, int]]:
    """One sample a second for `minutes`; `rss_mib(t_s)` gives the RSS."""
    return [(t, int(rss_mib(t) * MIB)) for t in range(int(minutes * 60))]


def test_warm_up_then_plateau_passes():
    """A process that grows 40 MiB while warming up, then holds, is fine."""
    v = judge(_series(60, lambda t: 400 + 40 * (1 - math.exp(-t / 300))))
    assert v.ok and abs(v.slope_mib_min) < 0.1


def test_steady_leak_fails_even_inside_the_total_growth_limit():
    """2.7 MiB/min for an hour (the issue's rate) fails; so does 0.8 MiB/min, whose growth from
    the first to the last quarter stays inside the 10 % limit: its second half still climbs."""
    assert not judge(_series(60, lambda t: 400 + 2.7 * t / 60)).ok
    v = judge(_series(60, lambda t: 400 + 0.8 * t / 60))
    assert not v.ok and "still growing" in v.detail and "(limit" in v.detail


def test_short_noisy_soak_is_not_a_leak():
    """In a 1-minute soak a single 4 MiB step of the allocator is noise, not a trend."""
    assert judge(_series(1, lambda t: 400 + (4 if t > 45 else 0))).ok
    assert judge(_series(1, lambda t: 400 + 60 * t / 60)).ok is False  # 60 MiB/min is a leak


def test_too_few_samples_are_not_judged():
    v = judge(_series(0.1, lambda t: 400 + t))
    assert v.ok and v.slope_mib_min is None and "not judged" in v.detail


def test_report_has_samples_table_and_plot(tmp_path):
    """The CSV holds every sample, the table one row per process, and a PNG is drawn."""
    series = {"GPU process (1)": _series(2, lambda t: 400.0), "worker 0 (2)": _series(2, lambda t: 60.0)}
    verdicts = {k: judge(v) for k, v in series.items()}
    paths = write_report(tmp_path, series, verdicts)
    assert (tmp_path / "soak-rss.csv").read_text().count("\n") == 1 + 2 * 120
    table = (tmp_path / "soak-rss.md").read_text()
    assert "| GPU process (1) | 400 | 400 | 400 | 400 | 400 |" in table and "| worker 0 (2) |" in table
    assert tmp_path / "soak-rss.png" in paths and (tmp_path / "soak-rss.png").stat().st_size > 1000
