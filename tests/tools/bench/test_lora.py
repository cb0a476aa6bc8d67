"""`ringserve bench lora` on the tiny model: base, mixed and swapping runs are measured, the
adapters it writes load as PEFT checkpoints, and a ratio under the goal exits 1."""

from __future__ import annotations

import json

from ringserve.tools.bench import lora


def test_the_three_runs_are_measured_and_a_missed_goal_exits_1(tiny_model_dir, capsys, monkeypatch):
    argv = ["--model", str(tiny_model_dir), "--streams", "4", "--tokens", "4", "--adapters", "2", "--rank", "4"]
    monkeypatch.setattr(lora, "GOAL", 0.0)
    assert lora.main([*argv, "--repeats", "2", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert set(r["tok_s"]) == {"base", "mixed", "swap"} and all(len(v) == 2 for v in r["tok_s"].values())
    assert r["mixed_over_base"] > 0 and r["swaps"] > 0 and r["slot_fill_ms"] > 0 and r["ok"]
    monkeypatch.setattr(lora, "GOAL", 1e9)  # a goal no run can meet
    assert lora.main([*argv, "--repeats", "1"]) == 1
    assert "FAILED" in capsys.readouterr().out
