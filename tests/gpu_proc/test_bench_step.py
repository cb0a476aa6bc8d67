"""`ringserve bench step`: runs end to end and reports the phase split and the overhead keys."""

from __future__ import annotations

import json

from ringserve.tools.bench.step import main


def test_bench_step_json_reports_every_phase(tiny_model_dir, capsys):
    """--json prints the per-phase split for each model and the host-overhead and sampler keys."""
    assert main(["--json", "--rows", "1,8", "--iters", "2", "--warmup", "1", "--model", str(tiny_model_dir)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["models"]) == {"tiny", "null", "flat"}
    for by_rows in report["models"].values():
        assert set(by_rows) == {"1", "8"}
        for m in by_rows.values():
            assert m["prepare"] > 0 and m["forward"] > 0 and m["sample"] > 0 and m["other"] > 0
            assert abs(m["total"] - (m["prepare"] + m["forward"] + m["sample"] + m["other"])) < 1e-9
    for key in ("host_overhead_ms_8", "sample_ms_8", "host_overhead_ms_1", "sample_ms_8_flat", "prepare_ms_8"):
        assert report[key] > 0
    assert report["models"]["tiny"]["8"]["forward"] > report["models"]["null"]["8"]["forward"]


def test_bench_step_table_and_bad_args(tiny_model_dir, capsys):
    """The table names the phases; bad --rows is a usage error."""
    assert main(["--rows", "1", "--iters", "1", "--warmup", "0", "--model", str(tiny_model_dir)]) == 0
    assert "prepare" in capsys.readouterr().out
    try:
        main(["--rows", "x"])
    except SystemExit as e:
        assert e.code == 2
    else:
        raise AssertionError("--rows x was accepted")


def test_bench_step_reference_runs_the_model_without_kernels(tiny_model_dir, capsys):
    """--reference adds the same model on the torch reference path, measured in the same run."""
    assert (
        main(
            [
                "--json",
                "--rows",
                "8",
                "--iters",
                "1",
                "--warmup",
                "0",
                "--model",
                str(tiny_model_dir),
                "--dtype",
                "bfloat16",
                "--reference",
            ]
        )
        == 0
    )
    report = json.loads(capsys.readouterr().out)
    assert set(report["models"]) == {"tiny", "tiny_ref", "null", "flat"}
    assert report["forward_ms_tiny_ref_8"] > 0 and report["forward_ms_tiny_8"] > 0


def test_bench_step_times_rows_verifying_drafts(tiny_model_dir, capsys):
    """--draft adds the same steps with every row verifying that many speculative tokens."""
    argv = ["--json", "--rows", "2", "--iters", "1", "--warmup", "0", "--draft", "3", "--model", str(tiny_model_dir)]
    assert main(argv) == 0
    tiny = json.loads(capsys.readouterr().out)["models"]["tiny"]
    assert set(tiny) == {"2", "2+3"} and tiny["2+3"]["forward"] > 0 and tiny["2+3"]["sample"] > 0
