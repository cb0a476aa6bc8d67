"""The load traces: the built-in mix's ranges and skew, JSONL reading, scaling, Poisson arrivals."""

from __future__ import annotations

import statistics

import pytest

from ringserve.tools.harness.trace import CONTEXT_LIMIT, TraceRequest, builtin_mix, poisson_arrivals, read_jsonl, scaled


def test_builtin_mix_stays_in_the_seed_ranges_and_context():
    """Prompts 50..8,000, outputs 1..1,000, and prompt + output never over the context limit."""
    trace = builtin_mix(3000, seed=1)
    assert all(50 <= r.prompt_tokens <= 8000 for r in trace)
    assert all(1 <= r.output_tokens <= 1000 for r in trace)
    assert all(r.prompt_tokens + r.output_tokens <= CONTEXT_LIMIT for r in trace)
    assert max(r.prompt_tokens for r in trace) == 8000  # the long tail reaches the clip


def test_builtin_mix_is_skewed_around_the_seed_means():
    """Medians sit well below the means (a long tail), and the means are near 1,250 and 300."""
    trace = builtin_mix(5000, seed=2)
    ps = [r.prompt_tokens for r in trace]
    os_ = [r.output_tokens for r in trace]
    assert statistics.median(ps) < 0.75 * statistics.mean(ps)
    assert statistics.median(os_) < 0.8 * statistics.mean(os_)
    assert 1050 < statistics.mean(ps) < 1350
    assert 230 < statistics.mean(os_) < 310


def test_builtin_mix_is_repeatable_and_rotates_keys():
    """The same seed gives the same trace; keys go round-robin."""
    assert builtin_mix(50, seed=7) == builtin_mix(50, seed=7)
    assert builtin_mix(50, seed=7) != builtin_mix(50, seed=8)
    assert [r.key for r in builtin_mix(5, keys=2)] == ["key-0", "key-1", "key-0", "key-1", "key-0"]


def test_read_jsonl_accepts_both_field_styles(tmp_path):
    """`prompt_tokens`/`output_tokens` and vLLM's `input_len`/`output_len` both read; keys default."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_tokens": 10, "output_tokens": 3, "key": "a"}\n\n{"input_len": 7, "output_len": 2}\n')
    assert read_jsonl(path, keys=3) == [TraceRequest(10, 3, "a"), TraceRequest(7, 2, "key-1")]


def test_read_jsonl_names_the_bad_line(tmp_path):
    """A malformed line fails with its file and line number."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"prompt_tokens": 10, "output_tokens": 3}\n{"prompt_tokens": 0, "output_tokens": 3}\n')
    with pytest.raises(ValueError, match="t.jsonl:2"):
        read_jsonl(path)


def test_scaled_keeps_at_least_one_token():
    """Scaling rounds and never goes below one token."""
    out = scaled([TraceRequest(1000, 300, "k"), TraceRequest(5, 1, "k")], 0.01)
    assert out == [TraceRequest(10, 3, "k"), TraceRequest(1, 1, "k")]
    with pytest.raises(ValueError):
        scaled([], 0)


def test_poisson_arrivals_have_the_asked_rate():
    """Exponential gaps: the mean gap is near 1/rate and gaps vary (not a fixed clock)."""
    t = poisson_arrivals(4000, 2.0, seed=3)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and all(g >= 0 for g in gaps)
    assert 0.47 < statistics.mean(gaps) < 0.53
    assert 0.4 < statistics.stdev(gaps) < 0.6  # exponential: stdev == mean
    assert poisson_arrivals(3, float("inf")) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError):
        poisson_arrivals(3, 0.0)
