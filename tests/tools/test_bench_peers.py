"""`ringserve bench peers`: the closed-loop client, its figures and checks, against a real ringserve."""

from __future__ import annotations

import json
import math

from ringserve.tools import bench_peers
from ringserve.tools.bench_peers import Answer, agreement, summarize
from ringserve.tools.peer_servers import probe_vllm


def test_summary_counts_tokens_and_flags_short_answers():
    """tok/s is completion tokens over wall time; an answer of the wrong length is counted."""
    good = Answer(status=200, times=[0.1, 0.2, 0.3, 0.4], tokens=4)
    short = Answer(status=200, times=[0.1, 0.3], tokens=2)
    failed = Answer(status=429, error="queue full")
    s = summarize([good, short, failed], wall_s=2.0, want_tokens=4)
    assert (s["requests"], s["ok"], s["wrong_length"], s["output_tokens"]) == (3, 2, 1, 6)
    assert s["tok_s"] == 3.0 and s["errors"] == ["queue full"]
    assert math.isclose(s["tpot_ms_p50"], (100.0 + 200.0) / 2)  # (0.3/3 and 0.2/1 s) -> median


def test_agreement_finds_where_answers_part():
    """Identical answers are counted; a differing one reports its first differing token."""
    a = [Answer(token_ids=[1, 2, 3]), Answer(token_ids=[4, 5, 6])]
    b = [Answer(token_ids=[1, 2, 3]), Answer(token_ids=[4, 9, 6])]
    assert agreement(a, b) == {"identical": 1, "compared": 2, "by": "token ids", "first_difference_at": [1]}


def test_missing_vllm_is_skipped_with_the_reason(tmp_path):
    """No --vllm-python, or one that is not a file, gives a reason instead of an error."""
    assert probe_vllm(None)[1].startswith("no vLLM Python given")
    assert "no such file" in probe_vllm(str(tmp_path / "python"))[1]


def test_drives_ringserve_and_checks_every_answer(tiny_model_dir, capsys):
    """A small run against a real ringserve: every request answered with exactly the requested
    tokens, figures for every concurrency, vLLM skipped and said so, JSON for machines."""
    rc = bench_peers.main(
        [
            "--json",
            "--models",
            str(tiny_model_dir),
            "--concurrency",
            "1,3",
            "--requests",
            "4",
            "--prompt-tokens",
            "20",
            "--output-tokens",
            "6",
            "--warmup",
            "1",
            "--dtype",
            "float32",
            "--ringserve-arg=--workers=1",
        ]
    )
    out = capsys.readouterr()
    report = json.loads(out.out)
    assert rc == 0
    assert report["vllm_skipped"] and "vLLM skipped" in out.err
    levels = report["models"][tiny_model_dir.name]["engines"]["ringserve"]["levels"]
    assert set(levels) == {"1", "3"}
    for s in levels.values():
        assert s["ok"] == s["requests"] == 4 and s["wrong_length"] == 0 and s["output_tokens"] == 24
        assert s["tok_s"] > 0 and s["ttft_ms_p95"] >= s["ttft_ms_p50"] > 0
    assert report["commit"] and len(report["loadavg_start"]) == 3
