"""`ringserve bench ring` runs every transport at a tiny scale and reports the ratios."""

from __future__ import annotations

import json

from ringserve.tools.bench import ring as bench_ring


def test_json_report_has_the_ratios(capsys):
    """--json prints one object with every case, latency percentiles and the three ratios."""
    assert bench_ring.main(["--json", "--scale", "0.005", "--repeat", "1"]) == 0
    report = json.loads(capsys.readouterr().out)
    for transport in ("ring", "zmq", "mpq"):
        cases = report["throughput"][transport]
        assert set(cases) == set(bench_ring.CASES)
        assert all(c["records_per_s"] > 0 and c["mb_per_s"] > 0 for c in cases.values())
        lat = report["latency"][transport]
        assert 0 < lat["p50_us"] <= lat["p99_us"]
    for key in ("ring_vs_zmq_p50_latency_1k", "ring_vs_zmq_throughput_16k", "ring_vs_zmq_throughput_msg_1k"):
        assert report[key] > 0
    assert set(report["goals"]) == {
        "p50_latency_at_most_1/5_of_zmq",
        "throughput_16k_at_least_3x_zmq",
        "msg_throughput_not_below_zmq",
    }


def test_table_names_ratios_and_goals(capsys):
    """The plain output is a table with the ratios and whether each goal is met."""
    assert bench_ring.main(["--scale", "0.002", "--repeat", "2", "--transports", "ring,zmq"]) == 0
    out = capsys.readouterr().out
    assert "16KiB" in out and "ring_vs_zmq_throughput_16k" in out and "goals:" in out
    assert "best of 2" in out


def test_bad_arguments_are_rejected(capsys):
    """An unknown transport is a usage error (exit 2)."""
    import pytest

    with pytest.raises(SystemExit) as exc:
        bench_ring.main(["--transports", "ring,carrier-pigeon"])
    assert exc.value.code == 2
    assert "carrier-pigeon" in capsys.readouterr().err
