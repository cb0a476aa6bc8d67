"""The scheduler tests' fake engine catches what it should: a wrong block table, a block read after
another prefix, a short table; and the harness's event streams follow its reference."""

from __future__ import annotations

import pytest

from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from tests.helpers.scheduler_fakes import FakeEngine, expected_stream, make_harness, make_request, reference_tokens


def test_fake_engine_follows_reference_for_one_row():
    """A single unbatched row driven by hand streams exactly the reference tokens."""
    eng = FakeEngine(4, 4)
    prompt = [5, 6, 7]
    sampling = RowSampling(seed=3, sample_index=0)
    table = [0, 1, 2, 3]
    out = eng.run(StepBatch([SeqStep(1, prompt, 0, table, sampling)])).token_ids
    for p in range(3, 8):
        out += eng.run(StepBatch([SeqStep(1, [out[-1]], p, table, sampling)])).token_ids
    want, _ = reference_tokens(prompt, 3, 0, 6, ignore_eos=True)
    assert out == want


def test_fake_engine_detects_a_wrong_block_table():
    """Reading through a table that points at another row's block changes the token: the
    scheduler tests built on this fake can fail."""
    eng = FakeEngine(4, 4)
    s = RowSampling(seed=3)
    eng.run(StepBatch([SeqStep(1, [5, 6, 7, 8], 0, [0]), SeqStep(2, [9, 10, 11, 12], 0, [1])]))
    right = eng.run(StepBatch([SeqStep(1, [13], 4, [0, 2], s)])).token_ids
    wrong = eng.run(StepBatch([SeqStep(1, [13], 4, [1, 2], s)])).token_ids
    assert right != wrong


def test_fake_engine_detects_a_block_computed_after_another_prefix():
    """Two sequences whose second blocks hold equal tokens after different first blocks: reading
    one's second block behind the other's first is caught (the keys there depend on the prefix)."""
    eng = FakeEngine(4, 2)
    eng.run(StepBatch([SeqStep(1, [5, 6, 7, 8], 0, [0, 1]), SeqStep(2, [9, 9, 7, 8], 0, [2, 3])]))
    eng.run(StepBatch([SeqStep(1, [], 4, [0, 1], RowSampling())]))  # its own blocks: fine
    with pytest.raises(AssertionError, match="computed after other tokens"):
        eng.run(StepBatch([SeqStep(1, [], 4, [0, 3], RowSampling())]))


def test_fake_engine_rejects_a_short_block_table():
    """A block table that does not cover the context is an error, not a silent read."""
    eng = FakeEngine(4, 4)
    with pytest.raises((AssertionError, IndexError)):
        eng.run(StepBatch([SeqStep(1, [1, 2, 3, 4, 5], 0, [0], RowSampling())]))


def test_harness_event_streams_match_reference():
    """A small mixed batch through the real scheduler streams each row's reference tokens."""
    h = make_harness(num_blocks=32, max_rows=4, prefill_budget=16)
    reqs = [make_request(i, 5 + 9 * i, max_tokens=12, seed=i) for i in range(4)]
    for r in reqs:
        assert h.sched.admit(r).accepted
    h.run_until_idle()
    for r in reqs:
        want, reason = expected_stream(h, r)
        assert h.tokens[(r.key, 0)] == want
        assert h.finishes[(r.key, 0)].reason == reason
    assert h.sched.kv.bm.num_free == 32
