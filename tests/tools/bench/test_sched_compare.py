"""`ringserve bench sched`: the step-cost fit, the four batching policies on the virtual clock, the CLI."""

from __future__ import annotations

import json

import pytest

from ringserve.tools.bench import sched_compare
from ringserve.tools.bench.batchers import ContinuousPolicy, RunToCompletionPolicy
from ringserve.tools.bench.sched_sim import DESIGN_7B_A100, SimExecutor, StepCost, replay
from ringserve.tools.harness.trace import TraceRequest, builtin_mix, poisson_arrivals, scaled

FLAT = StepCost(10.0, 1.0, 0.1)  # easy numbers: 10 ms + 1 ms/row + 0.1 ms/prompt token


def _policies(rows: int = 4, blocks: int = 512):
    return [
        RunToCompletionPolicy(max_rows=rows, window_s=None, num_blocks=blocks),
        RunToCompletionPolicy(max_rows=rows, window_s=0.01, num_blocks=blocks),
        ContinuousPolicy(max_rows=rows, prefill_budget=None, num_blocks=blocks),
        ContinuousPolicy(max_rows=rows, prefill_budget=32, num_blocks=blocks),
    ]


def test_fit_recovers_the_coefficients():
    """Least squares on exact samples gives back a, b and c."""
    true = StepCost(3.0, 0.5, 0.02)
    samples = [(r, p, true.ms(r, p)) for r in (1, 4, 16, 32) for p in (0, 64, 256)]
    fit = StepCost.fit(samples)
    assert fit.a_ms == pytest.approx(3.0) and fit.b_ms == pytest.approx(0.5) and fit.c_ms == pytest.approx(0.02)
    assert fit.r_squared(samples) == pytest.approx(1.0)


def test_fit_refuses_samples_that_cannot_separate_the_terms():
    """Decode-only samples cannot price prompt tokens: a clear error, not a garbage fit."""
    with pytest.raises(ValueError, match="cannot fit"):
        StepCost.fit([(r, 0, 10.0 + r) for r in range(1, 10)])


def test_design_model_matches_the_design():
    """The paper model: 25 ms at 1 row, 40 ms at 32 rows, 0.1 ms per prompt token."""
    assert DESIGN_7B_A100.ms(1, 0) == pytest.approx(25.0)
    assert DESIGN_7B_A100.ms(32, 0) == pytest.approx(40.0)
    assert DESIGN_7B_A100.ms(1, 1000) - DESIGN_7B_A100.ms(1, 0) == pytest.approx(100.0)


def test_every_policy_replays_exact_output_lengths_and_frees_its_blocks():
    """Each policy answers every request with exactly its trace length (replay checks) and ends clean."""
    trace = scaled(builtin_mix(24, seed=4), 0.05)
    arrivals = poisson_arrivals(24, 20.0, seed=4)
    for policy in _policies():
        res = replay(policy, trace, arrivals, SimExecutor(FLAT))
        assert res.output_tokens == sum(r.output_tokens for r in trace)
        assert len(res.ttft_s) == 24 and min(res.ttft_s) > 0


def test_static_batch_keeps_finished_rows_until_the_longest_ends():
    """Two answers of 2 and 10 tokens: static runs 10 two-row steps; continuous drops the short row."""
    trace = [TraceRequest(8, 2), TraceRequest(8, 10)]
    static = replay(
        RunToCompletionPolicy(max_rows=2, window_s=None, num_blocks=64), trace, [0.0, 0.0], SimExecutor(FLAT)
    )
    cont = replay(
        ContinuousPolicy(max_rows=2, prefill_budget=None, num_blocks=64), trace, [0.0, 0.0], SimExecutor(FLAT)
    )
    assert [rows for rows, _, _ in static.step_samples] == [2] * 10
    assert [rows for rows, _, _ in cont.step_samples] == [2, 2] + [1] * 8


def test_static_waits_for_a_full_batch_and_dynamic_for_its_window():
    """A lone early request waits for the second arrival under static, only 10 ms under dynamic."""
    trace = [TraceRequest(4, 3), TraceRequest(4, 3)]
    arrivals = [0.0, 1.0]
    static = replay(RunToCompletionPolicy(max_rows=2, window_s=None, num_blocks=64), trace, arrivals, SimExecutor(FLAT))
    dynamic = replay(
        RunToCompletionPolicy(max_rows=2, window_s=0.01, num_blocks=64), trace, arrivals, SimExecutor(FLAT)
    )
    assert static.ttft_s[0] >= 1.0
    assert dynamic.ttft_s[0] == pytest.approx(0.01 + FLAT.ms(1, 4) / 1e3)


def test_chunked_prefill_bounds_the_gap_a_long_prompt_puts_into_other_streams():
    """A 2,000-token prompt joining a decoding stream: chunking cuts the stream's longest gap."""
    trace = [TraceRequest(8, 40), TraceRequest(2000, 2)]
    arrivals = [0.0, 0.1]
    whole = replay(
        ContinuousPolicy(max_rows=2, prefill_budget=None, num_blocks=256), trace, arrivals, SimExecutor(FLAT)
    )
    chunked = replay(
        ContinuousPolicy(max_rows=2, prefill_budget=128, num_blocks=256), trace, arrivals, SimExecutor(FLAT)
    )
    assert whole.max_gap_s[0] > 0.2  # one 2,000-token prefill step: 10 + 2 + 200 ms
    assert chunked.max_gap_s[0] < 0.04  # the budget doubles with one decoding row: 256 tokens per step


def test_continuous_beats_static_on_a_skewed_trace():
    """On the built-in skew, continuous batching has far lower TTFT and higher throughput than static."""
    trace = builtin_mix(60, seed=5)
    arrivals = poisson_arrivals(60, 1.5, seed=5)
    static, _, cont, _ = [replay(p, trace, arrivals, SimExecutor(DESIGN_7B_A100)) for p in _policies(32, 7152)]
    assert cont.throughput_tok_s > 1.3 * static.throughput_tok_s
    assert cont.summary()["ttft_p50_ms"] < 0.1 * static.summary()["ttft_p50_ms"]


def test_real_engine_replay_and_fit(tiny_model_dir):
    """The tiny model on CPU runs the four schedulers to exact lengths; the fit over its steps is finite."""
    import torch

    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor
    from ringserve.tools.bench.sched_sim import EngineExecutor

    torch.set_num_threads(1)
    engine = build_executor(Config(device="cpu", dtype="float32", num_blocks=256), tiny_model_dir)
    trace = scaled(builtin_mix(6, seed=6), 0.02)
    arrivals = poisson_arrivals(6, 50.0, seed=6)
    rows = sched_compare.run_variants(
        sched_compare.VARIANTS[:4],
        trace,
        arrivals,
        lambda: EngineExecutor(engine),
        num_blocks=256,
        chunk_scale=0.02,
        vocab=(3, engine.vocab_size),
    )
    assert [r["kind"] for r in rows] == ["static", "dynamic", "continuous", "chunked"]
    assert all(r["output_tokens"] == sum(t.output_tokens for t in trace) for r in rows)
    samples = [s for r in rows for s in r["_samples"]]
    assert all(ms > 0 for _, _, ms in samples)
    cost = StepCost.fit(samples)
    assert all(map(lambda x: x == x, (cost.a_ms, cost.b_ms, cost.c_ms)))  # not NaN


def test_cli_paper_run_writes_json_and_a_plot(tmp_path, capsys):
    """`ringserve bench sched --skip-real` prints one row per variant and writes the PNG."""
    assert sched_compare.main(["--skip-real", "--design-requests", "10", "--json", "--plot", str(tmp_path)]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["runs"]["sim-design"]["rows"]
    assert [r["label"] for r in rows] == [v.label for v in sched_compare.VARIANTS]
    assert (tmp_path / "sched-sim-design-r1.5.png").stat().st_size > 1000


def test_repeated_rounds_report_medians_and_pool_the_step_samples():
    """With a deterministic executor, three rounds give the one-round figures and thrice the samples."""
    trace = scaled(builtin_mix(8, seed=9), 0.05)
    arrivals = poisson_arrivals(8, 10.0, seed=9)
    one, three = (
        sched_compare.run_variants(
            sched_compare.VARIANTS[:2], trace, arrivals, lambda: SimExecutor(FLAT), num_blocks=256, repeat=n
        )
        for n in (1, 3)
    )
    for a, b in zip(one, three):
        assert a["throughput_tok_s"] == b["throughput_tok_s"] and a["tpot_p95_ms"] == b["tpot_p95_ms"]
        assert len(b["_samples"]) == 3 * len(a["_samples"]) and b["rounds"] == 3
