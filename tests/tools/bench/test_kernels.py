"""`ringserve bench kernels` on a CPU host: its roofline arithmetic and its refusal without a GPU."""

from __future__ import annotations

import pytest
import torch

from ringserve.tools.bench import kernels as bk


def test_seven_b_weight_bytes_are_the_seeds_14_gb():
    """The streamed weights of the 7B shape (all but the embedding gather) are about 13.2 GB in fp16."""
    assert bk.dense_weight_bytes(bk.SEVEN_B) == 13_214_687_232


def test_kv_bytes_per_token_match_the_seed():
    """One token of 7B KV cache is 524,288 bytes (2 x 32 layers x 32 heads x 128 x 2 bytes)."""
    assert bk.kv_bytes(1, 1, 32, 32, 128) == 524_288
    assert bk.kv_bytes(32, 1024, 32, 32, 128) == 32 * 1024 * 524_288


def test_prefill_flops_count_weights_and_causal_attention():
    """Prefill FLOPs are 2 per weight per token plus the causal half of QK^T and PV."""
    tokens = 2048
    weights = bk.dense_weight_bytes(bk.SEVEN_B, dtype_bytes=1)
    attention = 2 * 2 * 32 * 32 * 128 * tokens * tokens / 2
    assert bk.prefill_flops(bk.SEVEN_B, tokens) == pytest.approx(2 * weights * tokens + attention)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("NVIDIA H100 80GB HBM3", (3350.0, 989.0)),
        ("NVIDIA H100 PCIe", (2000.0, 756.0)),
        ("NVIDIA A100-SXM4-80GB", (2039.0, 312.0)),
        ("NVIDIA A10G", (600.0, 125.0)),
        ("NVIDIA L40S", (864.0, 362.0)),
        ("Tesla T4", (None, None)),
    ],
)
def test_peak_lookup_prefers_the_most_specific_name(name, expected):
    """Device names map to their data-sheet peaks; the longest matching fragment wins; unknown is None."""
    assert bk.lookup_peaks(name) == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU path")
def test_refuses_without_a_gpu(capsys):
    """Without CUDA the bench measures nothing, says why, and exits 2."""
    assert bk.main(["--json"]) == 2
    assert "needs a CUDA device" in capsys.readouterr().err
