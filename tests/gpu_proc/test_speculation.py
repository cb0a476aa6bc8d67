"""N-gram speculative decoding in the scheduler: proposals, acceptance, rollback of what was not
kept (KV blocks, the prefix cache, `num_computed`), preemption mid-speculation, all through the
fake engine, whose tokens depend on every cached key, so a wrong rollback changes the stream."""

from __future__ import annotations

import pytest

from ringserve.gpu_proc.speculation import NgramIndex, Speculator, StepYield, accepted_prefix
from ringserve.gpu_proc.step_shape import StepShape
from tests.helpers.scheduler_fakes import copying_token, expected_stream, make_harness, make_request

SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3}


def _propose(tokens: list[int], k: int, lo: int = 2, hi: int = 4) -> list[int]:
    return NgramIndex(lo, hi).propose(lambda a, b: tokens[a:b], len(tokens), k)


# -- the proposer and the rule ---------------------------------------------------------------------


def test_proposes_what_followed_the_longest_matching_suffix():
    """The longest suffix that occurred before wins, and the draft is what followed it."""
    #         0  1  2  3  4  5  6  7  8  9 10
    tokens = [7, 1, 2, 9, 9, 5, 1, 2, 3, 4, 1, 2, 3]
    assert _propose(tokens, 2) == [4, 1]  # (1, 2, 3) at 6..8, not (2,) or (1, 2) at 1..2
    assert _propose([7, 1, 2, 8, 5, 1, 2], 3) == [8, 5, 1]


def test_proposes_nothing_below_ngram_min_and_stops_at_the_sequence_end():
    """No draft from a single repeated token under ngram_min 2; a draft never runs past the
    tokens that exist."""
    assert _propose([5, 6, 7, 6], 4) == []
    assert _propose([3, 4, 3, 4], 8) == [3, 4]


def test_the_index_grows_with_the_sequence():
    """One index asked again after the sequence grew finds grams of the new tokens too."""
    tokens = [1, 2, 3, 4]
    ix = NgramIndex(2, 3)
    seq = lambda a, b: tokens[a:b]  # noqa: E731
    assert ix.propose(seq, len(tokens), 2) == []
    tokens += [5, 3, 4]
    assert ix.propose(seq, len(tokens), 2) == [5, 3]


def test_accepted_prefix_is_the_longest_agreeing_prefix():
    assert accepted_prefix([4, 5, 6], [4, 5, 7, 1]) == 2
    assert accepted_prefix([4, 5, 6], [9, 5, 6, 1]) == 0
    assert accepted_prefix([4, 5, 6], [4, 5, 6, 1]) == 3


def _bar(b: float) -> StepYield:
    """A step whose bar stays `b` (a draft token costs nothing against a huge step)."""
    return StepYield(tokens=b * 1e9, ms=1e9, token_ms=1.0)


def test_a_row_drafts_only_what_its_acceptance_pays_for_and_learns_from_unsent_guesses():
    """A row drafts fewer tokens as the bar rises; one whose drafts keep failing stops drafting,
    and one whose unsent first guesses come true starts again."""
    spec = Speculator(4, 1, 2)
    tokens = [1, 2, 3, 1, 2, 3, 1, 2]
    seq = lambda a, b: tokens[a:b]  # noqa: E731
    assert spec.propose("r", seq, len(tokens), 4, _bar(0.1)) == [3, 1, 2]  # rate 0.5: 0.5^3 >= 0.1 > 0.5^4
    assert spec.propose("r", seq, len(tokens), 4, _bar(0.3)) == [3]
    for _ in range(10):
        spec.record("r", 3, 0)
    assert spec.rate("r") < 0.05 and spec.propose("r", seq, len(tokens), 4, _bar(0.1)) == []
    for _ in range(12):  # each unsent guess (3) is what the row then sampled
        tokens.append(3)
        tokens.append(1)
        assert spec.propose("r", seq, len(tokens) - 1, 4, _bar(1.1)) == []  # the guess for position len - 1
    assert spec.rate("r") > 0.5
    assert spec.propose("r", seq, len(tokens), 4, _bar(0.3))


def test_the_bar_rises_with_the_batch_and_with_every_draft_token():
    """One row on a step that mostly reads weights drafts almost anything; 32 rows on a step that
    mostly computes need a draft token kept ~90 % of the time; each added token raises the bar."""
    assert StepYield.for_step(1, 18.0, 1.0).bar < 0.06
    assert 0.85 < StepYield.for_step(32, 70.0, 2.0).bar < 0.95
    step = StepYield.for_step(8, 27.0, 1.3)
    bars = []
    for _ in range(6):
        bars.append(step.bar)
        step.add(0.9)
    assert bars == sorted(bars) and bars[-1] > bars[0] + 0.05


# -- through the scheduler -------------------------------------------------------------------------


def _run(num_blocks=64, reqs=(), **config):
    h = make_harness(num_blocks, model=copying_token, **config)
    for r in reqs:
        assert h.sched.admit(r).accepted
    h.run_until_idle()
    return h


def test_streams_equal_the_reference_and_drafts_are_kept_and_rolled_back():
    """Rows mixing prompt lengths stream exactly their reference tokens with speculation on
    (integrity checked after every step), drafts were both kept and rejected, steps emitted
    several tokens, and every block is free at the end."""
    reqs = [make_request(i, 5 + 7 * i, max_tokens=40, seed=i, ignore_eos=True) for i in range(4)]
    h = _run(64, reqs, max_rows=4, prefill_budget=32, block_size=4, **SPEC)
    for r in reqs:
        assert h.tokens[(r.key, 0)] == expected_stream(h, r)[0]
    st = h.sched.stats()
    assert 0 < st.spec_decode_num_accepted_tokens < st.spec_decode_num_draft_tokens
    per = st.spec_decode_accepted_per_position
    assert per[0] >= per[1] >= per[2] >= per[3] > 0 and sum(per) == st.spec_decode_num_accepted_tokens
    assert len(h.batches) < sum(40 for _ in reqs) / 2  # far fewer steps than tokens per row
    assert h.sched.kv.bm.num_free == 64


def test_speculation_changes_no_token_with_siblings_and_stop_tokens():
    """n = 2 siblings, max_tokens cutting a draft short and EOS: the streams are the ones plain
    decoding gives."""
    reqs = [make_request(0, 12, max_tokens=30, n=2, seed=3), make_request(1, 9, max_tokens=7, seed=4)]
    plain = _run(64, [make_request(0, 12, max_tokens=30, n=2, seed=3), make_request(1, 9, max_tokens=7, seed=4)])
    h = _run(64, reqs, **SPEC)
    assert h.tokens == plain.tokens
    assert {k: f.reason for k, f in h.finishes.items()} == {k: f.reason for k, f in plain.finishes.items()}
    assert h.sched.stats().spec_decode_num_drafts > 0


def _one_step_with_a_draft(h, req):
    """Step until the batch carries a draft for `req`; returns (batch, its SeqStep)."""
    for _ in range(200):
        batch = h.step()
        for s in batch.seqs:
            if s.seq_id == req.seq_id and s.draft:
                return batch, s
    raise AssertionError("no draft in 200 steps")


def test_rejected_drafts_give_their_blocks_back():
    """A draft that reached into fresh blocks and was rejected leaves the request with exactly the
    blocks its tokens need; the pool gets the rest back at once."""
    h = make_harness(32, model=lambda *a: 1 + hash(a) % 30, block_size=4, **SPEC)  # copies nothing
    req = make_request(0, [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=30, ignore_eos=True)
    assert h.sched.admit(req).accepted
    seen = 0
    for _ in range(60):
        if not h.sched.has_work:
            break
        batch = h.step()
        row = next((s for s in batch.seqs if s.seq_id == req.seq_id), None)
        if row is not None and row.draft and not req.is_finished:
            seen += 1
            assert len(req.block_ids) == h.sched.kv.blocks_for(req.num_tokens)
            assert h.sched.kv.bm.num_free == 32 - len(req.block_ids)
    assert seen and h.sched.stats().spec_decode_num_accepted_tokens < h.sched.stats().spec_decode_num_draft_tokens
    assert h.sched.kv.bm.num_free == 32


def test_rejected_tokens_are_never_registered_in_the_prefix_cache():
    """Every block the cache knows holds tokens a request really has at that place: a later
    request whose prompt is a sequence's real tokens finds its blocks, and none is found for a
    block of rejected guesses."""
    h = make_harness(64, model=copying_token, block_size=4, **SPEC)
    req = make_request(0, 10, max_tokens=40, ignore_eos=True)
    assert h.sched.admit(req).accepted
    h.run_until_idle()
    full = req.prompt_ids + req.generated
    cache = h.sched.kv.cache
    known = 0
    for b in range(64):
        e = cache.entry(b)
        if e is not None:
            known += 1
            assert any(tuple(full[j : j + 4]) == e.tokens for j in range(0, len(full) - 3, 4)), e.tokens
    assert known >= len(full) // 4 - 1
    assert h.sched.stats().spec_decode_num_accepted_tokens < h.sched.stats().spec_decode_num_draft_tokens


def test_preempted_rows_mid_speculation_recompute_and_stream_the_reference():
    """A pool too small for every row preempts rows that were speculating (some had drafts kept
    and rolled back before); each comes back, recomputes what it had kept and streams its
    reference tokens, and every block is free at the end."""
    from ringserve.gpu_proc.request import RequestState

    reqs = [make_request(i, 6 + 3 * i, max_tokens=36, seed=i, ignore_eos=True) for i in range(4)]
    h = make_harness(14, model=copying_token, max_rows=4, prefill_budget=32, block_size=4, admission_margin=0.0, **SPEC)
    for r in reqs:
        assert h.sched.admit(r).accepted
    drafted: set[int] = set()
    preempted_mid_speculation = 0
    while h.sched.has_work:
        before = {r.seq_id: r.state for r in reqs}
        batch = h.step()
        drafted |= {s.seq_id for s in batch.seqs if s.draft}
        for r in reqs:
            if r.state == RequestState.PREEMPTED and before[r.seq_id] != r.state and r.seq_id in drafted:
                preempted_mid_speculation += 1
    assert preempted_mid_speculation > 0 and h.sched.stats().spec_decode_num_accepted_tokens > 0
    for r in reqs:
        assert h.tokens[(r.key, 0)] == expected_stream(h, r)[0]
    assert h.sched.kv.bm.num_free == 14


def test_a_compute_bound_batch_gets_no_drafts():
    """When the fitted step time grows with every row as it does on a compute-bound step, a row
    whose drafts are kept half the time drafts nothing; when the step is mostly its fixed cost
    (reading the weights), it drafts."""
    reqs = [make_request(i, 9, max_tokens=20, seed=i, ignore_eos=True) for i in range(4)]
    h = make_harness(64, model=copying_token, max_rows=4, **SPEC)
    for _ in range(300):  # steps that cost 2 ms a row and nothing more
        for rows in (1, 2, 3, 4):
            h.sched.observe_step_time(2.0 * rows, StepShape.decode_rows(rows, 12))
    for r in reqs:
        assert h.sched.admit(r).accepted
    h.run_until_idle()
    assert h.sched.stats().spec_decode_num_drafts == 0
    reqs = [make_request(i, 9, max_tokens=20, seed=i, ignore_eos=True) for i in range(4)]
    h = _run(64, reqs, max_rows=4, **SPEC)  # the default cost constants: a large fixed cost per step
    assert h.sched.stats().spec_decode_num_drafts > 0


@pytest.mark.parametrize("field,value", [("speculative", "eagle"), ("num_speculative_tokens", 17), ("ngram_max", 0)])
def test_bad_speculation_settings_are_refused(field, value):
    from ringserve.config import Config, ConfigError

    with pytest.raises(ConfigError, match=field.split("_")[0]):
        Config(**{field: value})
