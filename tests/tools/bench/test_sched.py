"""`ringserve bench sched-overhead`: runs, reports the keys CI reads, at the row counts it claims."""

import json

import pytest

from ringserve.cli import main as cli_main
from ringserve.tools.bench import sched_overhead as bench_sched


def test_json_output_has_keys_and_full_rows(capsys):
    """--json prints sched_ms_32 / sched_ms_256, measured with (nearly) 32 and 256 rows sampling
    in every step: a finished row is replaced at the next pass (its prompt may take a few chunks)."""
    assert cli_main(["bench", "sched-overhead", "--json", "--passes", "30"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["sched_ms_32"] > 0 and out["sched_ms_256"] > 0
    assert 28 <= out["mean_batch_rows_32"] <= 32 and 240 <= out["mean_batch_rows_256"] <= 256
    assert out["queue_depth_32"] > 1000 and out["num_blocks"] == 7152


def test_measure_keeps_the_queue_deep_and_never_preempts():
    """The bench measures passes over a deep multi-key queue with no memory pressure."""
    r = bench_sched.measure(32, passes=20, queue_depth=300)
    assert r["mean_batch_rows"] >= 28 and r["queue_depth"] >= 250 and r["preemptions"] == 0
    assert r["p99_ms"] >= r["median_ms"] > 0


def test_rejects_bad_passes():
    """--passes must be positive."""
    with pytest.raises(SystemExit):
        bench_sched.main(["--passes", "0"])
