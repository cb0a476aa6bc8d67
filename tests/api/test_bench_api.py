"""`ringserve bench api` runs end to end and reports its key (no performance threshold here)."""

from __future__ import annotations

import json

import pytest

from ringserve.tools.bench import api as bench_api


@pytest.mark.parametrize("mode", ["ring", "inproc"])
def test_bench_api_json_reports_tokens_per_s(capsys, mode):
    """A short run streams tokens to every client and prints tokens_per_s_per_worker as JSON."""
    argv = [
        "--json",
        "--clients",
        "4",
        "--seconds",
        "0.5",
        "--warmup",
        "0.3",
        "--long-every",
        "0.2",
        "--stop",
        "QQQQ",
    ] + (["--inproc"] if mode == "inproc" else [])
    assert bench_api.main(argv) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mode"] == mode
    assert res["tokens_per_s_per_worker"] > 0 and res["token_events"] > 0
    assert res["long_prompts_sent"] >= 1 and res["long_prompt_tokens"] > 7000
    assert res["stop_strings"] == ["QQQQ"]
