"""`ringserve gpu-check` on a machine without CUDA: it says so, writes its JSON, and exits 2."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch


@pytest.mark.skipif(torch.cuda.is_available(), reason="this is the no-CUDA behaviour")
def test_gpu_check_without_cuda_says_so_and_exits_nonzero(tmp_path):
    out = tmp_path / "gpu-check.json"
    proc = subprocess.run(
        [sys.executable, "-m", "ringserve.cli", "gpu-check", "--out", str(out), "--skip-resources"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr
    assert "no CUDA device" in proc.stderr
    report = json.loads(out.read_text())
    assert report["env"]["cuda_available"] is False
    assert {report["sections"][s]["status"] for s in ("gpu_tests", "kernels", "step", "load", "hf")} == {"skipped"}
