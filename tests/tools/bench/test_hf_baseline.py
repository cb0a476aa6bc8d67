"""The HF transformers baseline: static batches through `generate` on the virtual clock, and the
comparison with ringserve's engine in the same run."""

from __future__ import annotations

import json

import pytest

from ringserve.tools.bench import sched_compare
from ringserve.tools.bench.hf_baseline import compare, load_hf_model, markdown, run_hf
from ringserve.tools.harness.trace import TraceRequest


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir):
    import torch

    torch.set_num_threads(1)
    return load_hf_model(str(tiny_model_dir))


def test_static_batches_replay_lengths_and_wait_for_a_full_batch(hf_model):
    """Lengths replay exactly; a batch waits for its last member; all members share the first token."""
    trace = [TraceRequest(5, 3), TraceRequest(9, 1), TraceRequest(4, 6), TraceRequest(7, 2), TraceRequest(3, 4)]
    arrivals = [0.0, 0.5, 0.6, 0.7, 5.0]
    res = run_hf(hf_model, trace, arrivals, batch=2)
    assert res.output_tokens == 16
    assert res.ttft_s[0] >= 0.5  # the first batch fired when its second member arrived
    assert res.ttft_s[0] - res.ttft_s[1] == pytest.approx(0.5)  # one first-token time for the batch
    assert res.steps == 3 + 6 + 4  # each batch runs to its longest answer
    assert len(res.tpot_s) == 4 and all(t > 0 for t in res.tpot_s)


def test_compare_runs_both_systems_on_one_trace(tiny_model_dir):
    """Both sides produce every token of the trace; the ratio is their throughput quotient."""
    trace = [TraceRequest(3 + i % 5, 1 + (i * 7) % 9) for i in range(8)]
    result = compare(str(tiny_model_dir), trace, [0.0] * 8, batch=4, chunk=16, num_blocks=128)
    want = sum(t.output_tokens for t in trace)
    assert result["ringserve"]["output_tokens"] == result["hf"]["output_tokens"] == want
    assert result["throughput_ratio"] == pytest.approx(
        result["ringserve"]["throughput_tok_s"] / result["hf"]["throughput_tok_s"]
    )
    assert "Throughput ratio" in markdown(result)


def test_bench_sched_with_hf_row(tiny_model_dir, capsys):
    """`ringserve bench sched --hf` adds the HF row and the ratio to the real run."""
    code = sched_compare.main(
        [
            "--requests",
            "6",
            "--scale",
            "0.05",
            "--prompt-scale",
            "0.01",
            "--limit-variants",
            "4",
            "--hf",
            "--model-dir",
            str(tiny_model_dir),
            "--design-requests",
            "6",
            "--rate",
            "50",
            "--num-blocks",
            "256",
            "--repeat",
            "1",
            "--json",
        ]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    real = report["runs"]["real"]
    assert [r["kind"] for r in real["rows"]] == ["static", "dynamic", "continuous", "chunked", "hf"]
    assert real["hf_throughput_ratio"] > 0
    assert "fit" in report["runs"]["sim-fit"]
