"""`ringserve bench fairness`: its servers, floods and figures, scaled down on the tiny model."""

from __future__ import annotations

import json

from ringserve.tools.bench import fairness as bench_fairness


def test_reports_b_admitted_and_its_figures_for_each_variant(tiny_model_dir, capsys):
    """Two variants in palindrome order, the burst flood: every B admitted (exit 0), and each run
    reports B's TTFT and server queue wait, A's tokens/s and the longest step seen."""
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
        # NOTE: A's 200-token answers may all outlast the 4 s window on a slow box; its tokens may not
        assert r["a_answered"] + r["a_refused"] <= 40 and r["a_tokens_per_s"] > 0 and r["longest_step_ms"] > 0
    assert set(out["medians_of_runs"]) == {"defaults | burst", "--prefill-budget 64 | burst"}


def test_the_in_flight_flood_measures_a_alone_and_fails_a_broken_promise(tiny_model_dir, capsys):
    """The in-flight flood also runs A alone for as long, and reports A's share of it; the exit
    status is 1 when a promise does not hold (here a p95 bound no server can meet)."""
    argv = ["--model", str(tiny_model_dir), "--flood", "in-flight", "--in-flight", "8", "--b-requests", "2", "--json"]
    rc = bench_fairness.main(argv)
    out = json.loads(capsys.readouterr().out)
    run = out["runs"][0]
    assert run["a_tokens_per_s"] > 0 and run["a_alone_tokens_per_s"] > 0
    assert run["summary"]["a_share_of_alone"] > 0
    assert rc == (0 if bench_fairness.run_holds(bench_fairness.Run(**{**run, "summary": run["summary"]})) else 1)
    bench_fairness.B_TTFT_P95_MS = 0.0  # planted: a promise that cannot hold
    try:
        assert not bench_fairness.run_holds(bench_fairness.Run(**run))
    finally:
        bench_fairness.B_TTFT_P95_MS = 1000.0
