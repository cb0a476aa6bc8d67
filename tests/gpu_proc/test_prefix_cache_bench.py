"""`ringserve bench prefix` runs end to end on tiny sizes and reports what it measured."""

import json

from ringserve.tools.bench import prefix as bench_prefix


def test_bench_prefix_json_report(tiny_model_dir, capsys):
    """Small sizes: the cached request really hits its prefix, the trace hits the system prompt,
    and the caching-on and caching-off streams are identical."""
    rc = bench_prefix.main(
        [
            "--json",
            "--model",
            str(tiny_model_dir),
            "--prefix",
            "64",
            "--suffix",
            "8",
            "--reps",
            "1",
            "--requests",
            "4",
            "--share",
            "1.0",
            "--system",
            "48",
            "--max-tokens",
            "2",
            "--blocks",
            "64",
            "--trace-reps",
            "2",
        ]
    )
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ttft"]["cached_tokens"] == 64 and report["ttft"]["prompt_tokens"] == 72
    trace = report["trace"]
    assert trace["shared_requests"] == 4 and trace["streams_identical"] is True
    assert trace["on"]["prompt_tokens_cached"] == 3 * 48 and trace["off"]["prompt_tokens_cached"] == 0
