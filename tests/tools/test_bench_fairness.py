"""`ringserve bench fairness`: its servers, floods and figures, scaled down on the tiny model."""

from __future__ import annotations

import json

from ringserve.tools import bench_fairness


def test_reports_b_admitted_and_its_figures_for_each_variant(tiny_model_dir, capsys):
    """Two variants in palindrome order, the burst flood: every B admitted (exit 0), and each run
    reports B's TTFT and server queue wait and the longest step seen."""
    rc = bench_fairness.main(
        ["--model", str(tiny_model_dir), "--flood", "burst", "--burst", "40", "--b-requests", "3"]
        + ["--variant", "--prefill-budget 64", "--runs", "2", "--json"]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0
    order = [r["variant"] for r in out["runs"]]
    assert order == ["defaults", "--prefill-budget 64", "--prefill-budget 64", "defaults"]
    for r in out["runs"]:
        assert r["b_admitted"] == r["b_sent"] == 3
        assert len(r["b_ttft_ms"]) == 3 and len(r["b_queue_ms"]) == 3
        assert 0 < r["a_answered"] <= 40 and r["longest_step_ms"] > 0
    assert set(out["medians_of_runs"]) == {"defaults | burst", "--prefill-budget 64 | burst"}
