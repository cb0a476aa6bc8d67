"""`ringserve bench quant` on a tiny converted GGUF: it reports what is served and how far the
blocks move the model, and exits 1 when a bound fails."""

from __future__ import annotations

import json

import pytest

from ringserve.tools.bench import quant
from tests.helpers.gguf_files import write_llama_gguf

pytest.importorskip("gguf")


def test_a_file_is_measured_and_a_failed_bound_exits_1(tiny_model_dir, tmp_path, capsys, monkeypatch):
    path = str(write_llama_gguf(tiny_model_dir, tmp_path / "tiny-q8.gguf", quant="Q8_0"))
    assert quant.main(["--models", path, "--tokens", "256", "--greedy-tokens", "8", "--json"]) == 0
    (r,) = json.loads(capsys.readouterr().out)["files"]
    assert r["served"]["quantization"] == "gguf" and set(r["served"]["formats"]) == {"Q8_0"}
    assert r["loglikelihood_bound"] == 0.01 and r["ok"]
    assert 0.9 < r["memory_ratio"] <= quant.MEMORY_BOUND and r["loglikelihood"]["tokens"] == 256
    assert 0 <= r["top1_agreement"] <= 1 and len(r["greedy_equal_before_first_difference"]) == len(quant.PROMPTS)
    monkeypatch.setattr(quant, "MEMORY_BOUND", 0.5)  # a bound the file cannot meet
    assert quant.main(["--models", path, "--tokens", "64", "--greedy-tokens", "2"]) == 1
    assert "FAILED" in capsys.readouterr().out
