"""Scheduler pass on tiny pools: exact block ids, chunking, preemption, n > 1 sharing, stops."""

import pytest

from ringserve.gpu_proc.request import RequestState
from tests.helpers.scheduler_fakes import expected_stream, make_harness, make_request


def _tables(batch):
    return [(s.seq_id, s.start_pos, len(s.token_ids), list(s.block_table), s.sampling is not None) for s in batch.seqs]


def test_join_allocates_prompt_blocks_and_decode_grows_one_block_per_boundary():
    """A 6-token prompt takes blocks [0, 1]; the token at position 8 takes block 2."""
    h = make_harness(num_blocks=8, block_size=4)
    r = make_request(1, 6, max_tokens=8, ignore_eos=True)
    assert h.sched.admit(r).accepted
    b = h.step()
    assert [(s.start_pos, s.token_ids, s.block_table) for s in b.seqs] == [(0, r.prompt_ids, [0, 1])]
    assert b.seqs[0].sampling is not None
    h.step()  # position 6
    h.step()  # position 7
    assert r.block_ids == [0, 1]
    b = h.step()  # position 8 crosses into a third block
    assert b.seqs[0].start_pos == 8 and b.seqs[0].block_table == [0, 1, 2]
    assert h.sched.kv.bm.num_free == 5
    h.run_until_idle()
    assert h.tokens[(r.key, 0)] == expected_stream(h, r)[0]
    assert h.finishes[(r.key, 0)].reason == "length" and h.sched.kv.bm.num_free == 8


def test_prompt_is_prefilled_in_budget_chunks_and_samples_only_at_the_end():
    """With a 4-token budget a 10-token prompt runs as 4 + 4 + 2; only the last chunk samples."""
    h = make_harness(num_blocks=8, block_size=4, max_rows=1, prefill_budget=4)
    r = make_request(1, 10, max_tokens=2, ignore_eos=True)
    h.sched.admit(r)
    chunks = [_tables(h.step())[0] for _ in range(3)]
    sid = r.seq_id
    assert chunks == [(sid, 0, 4, [0, 1, 2], False), (sid, 4, 4, [0, 1, 2], False), (sid, 8, 2, [0, 1, 2], True)]
    assert len(h.tokens[(r.key, 0)]) == 1  # first token right after the last chunk


def test_decode_rows_come_first_and_prefill_fills_the_budget_oldest_first():
    """One step: every decoding row's token, then prompt chunks in admission order up to the budget."""
    h = make_harness(num_blocks=32, block_size=4, max_rows=32, prefill_budget=8)
    a = make_request(1, 3, max_tokens=20, ignore_eos=True)
    h.sched.admit(a)
    h.step()  # a prefilled; it decodes from now on
    b, c = make_request(2, 40, max_tokens=2), make_request(3, 40, max_tokens=2)
    h.sched.admit(b)
    h.sched.admit(c)
    assert h.sched.prefill_budget_for(1) == 64  # one decoding row of 32: the budget is raised 8x
    batch = h.step()
    assert [(s.seq_id, s.start_pos, len(s.token_ids)) for s in batch.seqs] == [
        (a.seq_id, 3, 1),
        (b.seq_id, 0, 40),
        (c.seq_id, 0, 24),
    ]


def test_prefill_budget_rule():
    """Budget = prefill_budget * min(8, max_rows // decode_rows), never below prefill_budget."""
    h = make_harness(max_rows=32, prefill_budget=256)
    got = [h.sched.prefill_budget_for(d) for d in (0, 1, 4, 5, 8, 16, 17, 32)]
    assert got == [2048, 2048, 2048, 1536, 1024, 512, 256, 256]


def test_newest_request_is_preempted_and_resumes_without_re_emitting():
    """Pool of 4 blocks: when the oldest needs a block the newest is preempted, its blocks freed,
    and it later recomputes prompt + produced tokens in one chunk and continues the same stream."""
    # NOTE: exact ids of the no-cache path; with the prefix cache b would hit its own block 1
    # (test_prefix_cache_scheduler.py pins that).
    h = make_harness(num_blocks=4, block_size=4, prefix_caching=False)
    a = make_request(1, 4, max_tokens=6, ignore_eos=True, seed=11)
    b = make_request(2, 4, max_tokens=8, ignore_eos=True, seed=12)
    h.sched.admit(a)
    h.sched.admit(b)
    h.step()
    h.step()
    assert (a.block_ids, b.block_ids) == ([0, 2], [1, 3])
    for _ in range(3):
        h.step()
    batch = h.step()  # a needs a block at position 8: b (newest) is preempted
    assert [s.seq_id for s in batch.seqs] == [a.seq_id]
    assert b.state == RequestState.PREEMPTED and h.sched.stats().preemptions == 1
    assert len(h.tokens[(b.key, 0)]) == 5 and b.block_ids == []
    assert a.is_finished  # a sampled its 6th token in that step and left
    batch = h.step()  # b rejoins: 4 prompt + 5 produced tokens recomputed, then samples its 6th
    assert _tables(batch) == [(b.seq_id, 0, 9, [3, 0, 2], True)]
    assert b.state == RequestState.DECODE
    h.run_until_idle()
    for r in (a, b):
        assert h.tokens[(r.key, 0)] == expected_stream(h, r)[0]
    assert h.sched.kv.bm.num_free == 4


@pytest.mark.parametrize("n", [1, 2])
def test_preempted_seeded_outputs_equal_an_unpreempted_run(n):
    """The same seeded requests (n samples each) on a roomy pool and on a pool that forces
    preemptions stream the same tokens."""

    def run(num_blocks):
        h = make_harness(num_blocks=num_blocks, block_size=4, prefill_budget=8)
        reqs = [make_request(i, 5 + 3 * i, max_tokens=16, seed=100 + i, ignore_eos=True, n=n) for i in range(6)]
        for r in reqs:
            assert h.sched.admit(r).accepted
        h.run_until_idle()
        streams = {(r.key, i): h.tokens[(r.key, i)] for r in reqs for i in range(n)}
        return streams, h.sched.stats().preemptions, h.sched.kv.bm.num_free

    roomy, p0, free0 = run(200)
    tight, p1, free1 = run(12 * n)
    assert p0 == 0 and p1 > 0
    assert tight == roomy
    assert (free0, free1) == (200, 12 * n)


def test_unseeded_request_gets_a_seed_at_admission_that_survives_preemption():
    """seed=None draws one seed for the Submit; every sample carries it with its own index."""
    h = make_harness(num_blocks=16)
    r = make_request(1, 3, seed=None, n=3)
    h.sched.admit(r)
    samples = h.sched.snapshot().live[r.key]
    seeds = {s.row_sampling.seed for s in samples}
    assert len(seeds) == 1 and [s.row_sampling.sample_index for s in samples] == [0, 1, 2]


def test_n_samples_share_full_prompt_blocks_and_compute_their_own_tail():
    """n=2, 6-token prompt, 4-token blocks: sample 0 prefills into [0, 1]; sample 1 joins once
    block 0 is registered, reads it by reference and computes its tail (tokens 4-5) into its own
    block 2. No block is copied; the samples diverge."""
    h = make_harness(num_blocks=8, block_size=4)
    r = make_request(1, 6, max_tokens=3, n=2, ignore_eos=True, seed=5)
    h.sched.admit(r)
    second = h.sched.snapshot().live[r.key][1]
    b = h.step()
    assert _tables(b) == [(r.seq_id, 0, 6, [0, 1], True)]
    b = h.step()
    assert _tables(b) == [(r.seq_id, 6, 1, [0, 1], True), (second.seq_id, 4, 2, [0, 2], True)]
    assert h.sched.kv.bm.ref_count(0) == 2
    h.run_until_idle()
    streams = [h.tokens[(r.key, i)] for i in range(2)]
    assert streams == [expected_stream(h, r, i)[0] for i in range(2)]
    assert streams[0] != streams[1]
    assert h.sched.kv.bm.num_free == 8


def test_n_samples_with_block_aligned_prefix_compute_only_the_last_token():
    """A 5-token prompt: sample 1 finds block 0 cached and computes only token 4."""
    h = make_harness(num_blocks=8, block_size=4)
    r = make_request(1, 5, max_tokens=3, n=2, ignore_eos=True)
    h.sched.admit(r)
    second = h.sched.snapshot().live[r.key][1]
    h.step()
    b = h.step()
    assert (r.block_ids, second.block_ids) == ([0, 1], [0, 2])
    assert [(s.start_pos, len(s.token_ids)) for s in b.seqs] == [(5, 1), (4, 1)]
    h.run_until_idle()
    assert h.sched.kv.bm.num_free == 8


def test_short_prompt_samples_join_together():
    """A prompt shorter than a block has nothing to share: all samples join in the first pass."""
    h = make_harness(num_blocks=8, block_size=4)
    r = make_request(1, 3, max_tokens=2, n=3, ignore_eos=True)
    h.sched.admit(r)
    assert [(s.start_pos, len(s.token_ids)) for s in h.step().seqs] == [(0, 3)] * 3
    h.run_until_idle()
    assert [h.tokens[(r.key, i)] for i in range(3)] == [expected_stream(h, r, i)[0] for i in range(3)]


def test_stop_token_and_max_tokens_finish_rows():
    """A sampled EOS finishes with stop, reaching max_tokens with length; blocks return at once."""
    h = make_harness(num_blocks=16)
    reqs = [make_request(i, 4, max_tokens=30, seed=i) for i in range(20)]
    for r in reqs:
        h.sched.admit(r)
    h.run_until_idle()
    reasons = set()
    for r in reqs:
        want, reason = expected_stream(h, r)
        assert h.tokens[(r.key, 0)] == want and h.finishes[(r.key, 0)].reason == reason
        reasons.add(reason)
    assert reasons == {"stop", "length"}
    assert h.sched.kv.bm.num_free == 16


def test_row_cap_holds_back_joins():
    """With max_rows=2 a third request waits until a row leaves."""
    h = make_harness(num_blocks=16, max_rows=2)
    reqs = [make_request(i, 3, max_tokens=3 + i, ignore_eos=True) for i in range(3)]
    for r in reqs:
        h.sched.admit(r)
    h.step()
    assert [r.state for r in reqs] == [RequestState.DECODE, RequestState.DECODE, RequestState.QUEUED]
    assert h.sched.stats().running_rows == 2 and h.sched.stats().queue_depth == 1
    h.step()
    h.step()  # request 0 samples its 3rd token and leaves
    assert reqs[0].is_finished and reqs[2].state == RequestState.QUEUED
    h.step()
    assert reqs[2].state == RequestState.DECODE


def test_join_keeps_the_free_block_margin():
    """A request that would eat into the 5 % margin waits while others run, joins when idle."""
    h = make_harness(num_blocks=40, block_size=4)  # margin: 2 blocks
    a = make_request(1, 4, max_tokens=3, ignore_eos=True)
    big = make_request(2, 4 * 38, max_tokens=1, ignore_eos=True)  # 38 blocks
    h.sched.admit(a)
    h.step()
    h.sched.admit(big)
    h.step()
    assert big.state == RequestState.QUEUED  # 39 free < 38 + 2
    h.run_until_idle()
    assert big.is_finished and h.finishes[(big.key, 0)].reason == "length"


def test_stats_count_tokens_and_blocks():
    """stats() reports rows, queue, blocks and token counters."""
    h = make_harness(num_blocks=16, max_rows=1)
    a, b = make_request(1, 5, max_tokens=2, ignore_eos=True), make_request(2, 7, max_tokens=2, ignore_eos=True)
    h.sched.admit(a)
    h.sched.admit(b)
    h.step()
    s = h.sched.stats()
    assert (s.running_rows, s.queue_depth) == (1, 1)
    assert s.queued_gpu_seconds > 0 and s.kv_blocks_free == 15 and s.kv_blocks_total == 16
    h.run_until_idle()
    s = h.sched.stats()
    assert (s.prompt_tokens_total, s.generation_tokens_total, s.queue_depth, s.queued_gpu_seconds) == (12, 4, 0, 0)


def test_step_times_recalibrate_admission_costs():
    """observe_step_time with the last batch's counts (1 decode row, no prefill) feeds the decode
    fit: 1-row steps far slower than the design's 25 ms raise c_decode; faster ones lower it."""
    h = make_harness(num_blocks=16)
    h.sched.admit(make_request(1, 3, max_tokens=50, ignore_eos=True))
    h.step()
    before = h.sched.stats().c_decode_ms
    h.step()  # one decode row
    assert (h.sched.last_shape.decode, h.sched.last_shape.prefill, h.sched.last_shape.kind) == (1, 0, "decode")
    for _ in range(50):
        h.sched.observe_step_time(60.0)
    slow = h.sched.stats().c_decode_ms
    for _ in range(200):
        h.sched.observe_step_time(5.0)
    assert slow > before > h.sched.stats().c_decode_ms


def test_newest_request_needing_a_block_preempts_itself_and_leaves_the_step():
    """Pool of 3: both rows cross a block boundary in one step; the older takes the last block,
    the newer (the preemption victim) is taken out of the step it was being added to."""
    h = make_harness(num_blocks=3, block_size=4)
    a = make_request(1, 4, max_tokens=4, ignore_eos=True, seed=1)
    b = make_request(2, 4, max_tokens=4, ignore_eos=True, seed=2)
    h.sched.admit(a)
    h.sched.admit(b)
    h.step()
    batch = h.step()
    assert _tables(batch) == [(a.seq_id, 4, 1, [0, 2], True)]
    assert b.state == RequestState.PREEMPTED and len(h.tokens[(b.key, 0)]) == 1
    h.run_until_idle()
    assert [h.tokens[(r.key, 0)] for r in (a, b)] == [expected_stream(h, r)[0] for r in (a, b)]
    assert h.sched.kv.bm.num_free == 3


def test_preemption_takes_a_newer_request_mid_prefill():
    """An older decoding row needing a block preempts a newer request still in chunked prefill."""
    # NOTE: no cache, so b's freed blocks return in FIFO order (the cache parks full ones instead)
    h = make_harness(num_blocks=6, block_size=4, max_rows=2, prefill_budget=1, prefix_caching=False)
    a = make_request(1, 2, max_tokens=8, ignore_eos=True)
    h.sched.admit(a)
    h.step()  # a prefilled into [0]
    b = make_request(2, 16, max_tokens=2, ignore_eos=True)
    h.sched.admit(b)  # needs 4 blocks: 5 free >= 4 + 1 margin
    batch = h.step()  # b joins with [1, 2, 3, 4]; a decodes at position 2
    assert b.block_ids == [1, 2, 3, 4] and b.num_computed == 2 and len(batch.seqs) == 2
    h.step()  # a at 3; b to 4
    batch = h.step()  # a at 4 takes the last free block; b to 6
    assert a.block_ids == [0, 5] and h.sched.kv.bm.num_free == 0
    for _ in range(3):
        h.step()  # a at 5..7; b to 12
    assert b.num_computed == 12 and b.generated == []
    batch = h.step()  # a at 8 needs a block: none free, b is preempted mid-prefill
    assert b.state == RequestState.PREEMPTED and b.block_ids == []
    assert _tables(batch) == [(a.seq_id, 8, 1, [0, 5, 1], True)]
    h.run_until_idle()
    assert [h.tokens[(r.key, 0)] for r in (a, b)] == [expected_stream(h, r)[0] for r in (a, b)]
    assert h.sched.kv.bm.num_free == 6


def test_finished_requests_are_released_before_their_deadline():
    """A finished request is not kept alive until its deadline passes: after 600 requests with a
    far deadline have finished, the scheduler holds on to at most 64 of them (issue 15: the GPU
    process's RSS grew with every request of the last request_timeout_s)."""
    import gc

    from ringserve.gpu_proc.request import Request

    h = make_harness(num_blocks=64, block_size=4, max_rows=8)
    for rid in range(600):
        assert h.sched.admit(make_request(rid, 5, max_tokens=2, ignore_eos=True)).accepted
        if rid % 8 == 7:
            h.run_until_idle()
    h.run_until_idle()
    h.tokens.clear()
    h.finishes.clear()
    gc.collect()
    held = sum(1 for o in gc.get_objects() if type(o) is Request)
    assert held <= 64 + 8


def test_step_requests_name_what_the_step_feeds_once_per_submit():
    """What the step-in-flight record names (`Scheduler.step_requests`): a running request whose
    chunk the budget left out of this step is not in it, nor a queued one; two samples of one
    Submit are one request."""
    h = make_harness(num_blocks=64, block_size=4, max_rows=2, prefill_budget=4)
    a, b, c = (make_request(i, 40, max_tokens=4, ignore_eos=True) for i in (1, 2, 3))
    for r in (a, b, c):
        assert h.sched.admit(r).accepted
    batch = h.sched.schedule(h.now)
    assert {s.seq_id for s in batch.seqs} == {a.seq_id}  # b joined (a row is free) but got no budget
    assert b.state == RequestState.PREFILL and c.state == RequestState.QUEUED
    assert h.sched.step_requests(batch) == [a]
    h.sched.update(h.engine.run(batch))
    h.run_until_idle()
    twins = make_request(4, 3, max_tokens=6, ignore_eos=True, n=2)
    assert h.sched.admit(twins).accepted
    for _ in range(4):
        batch = h.sched.schedule(h.now)
        named = h.sched.step_requests(batch)
        assert [r.key for r in named] == [twins.key] and len(named) == 1
        h.sched.update(h.engine.run(batch))
    assert len(batch.seqs) == 2  # both samples decode in the last of those steps
