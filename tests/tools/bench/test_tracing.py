"""`ringserve bench tracing` on the tiny model, one round: the four variants run on real servers,
the spans go where the counters say (all exported with the collector up, dropped at the bound with
it down or slow), and a missed check exits 1."""

from __future__ import annotations

import json

from ringserve.api.request_trace import QUEUE_SPANS
from ringserve.tools.bench import tracing


def test_each_variant_is_measured_and_the_bound_holds(tiny_model_dir, capsys):
    # 1,500 requests of ~7 spans each: more than the queue, so dead and slow must drop some
    argv = ["--model", str(tiny_model_dir), "--rounds", "1", "--requests", "1500", "--output-tokens", "2"]
    argv += ["--concurrency", "32", "--min-ratio", "0.5", "--json"]
    code = tracing.main(argv)
    report = json.loads(capsys.readouterr().out)
    assert [r["variant"] for r in report["runs"]] == list(tracing.VARIANTS)
    assert code == 0, [c for c in report["checks"] if not c["ok"]]
    runs = {r["variant"]: r for r in report["runs"]}
    assert runs["off"]["spans_exported"] == runs["off"]["spans_dropped"] == 0
    assert runs["up"]["spans_exported"] == runs["up"]["spans_received"] > QUEUE_SPANS
    assert runs["dead"]["spans_exported"] == 0 and runs["dead"]["spans_dropped"] > 0
    assert set(report["medians"]["dead"]) >= {"tok_s", "tok_s_vs_up", "tok_s_vs_off", "ttft_ms_p95"}

    class Strict:  # the same runs judged by a limit no run meets
        min_ratio, rss_mib = 1e9, -1.0

    failed = [c for c, ok in tracing.checks(report["runs"], report["medians"], Strict) if not ok]
    assert any("tok/s" in c for c in failed) and any("RSS" in c for c in failed)


def test_a_run_past_the_bound_that_dropped_nothing_fails():
    run = {"spans_exported": 9000, "spans_failed": 0, "spans_dropped": 0, "spans_waiting": 0, "wall_s": 4.0}
    assert not tracing.bound_check("dead", run)[1]  # 9,000 made in 4 s: the queue and 2 batches hold 5,120
    assert tracing.bound_check("dead", run | {"spans_dropped": 3000})[1]
    assert tracing.bound_check("dead", run | {"wall_s": 50.0})[1]  # 25 batches drain it: no drop needed
