"""Scheduler + prefix cache on tiny pools with the fake engine: exact hits, block ids and free-list
order, and streams equal to the no-cache reference (the fake reads every context back through the
block table, so a block holding the wrong tokens changes the stream)."""

import random

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.prefix_cache import PrefixCache
from ringserve.gpu_proc.request import RequestState
from ringserve.gpu_proc.scheduler import Scheduler
from tests.helpers.scheduler_fakes import EOS, FakeEngine, Harness, expected_stream, make_harness, make_request

P = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20]  # 10 tokens: two full 4-token blocks and a partial one


def _serve(h: Harness, *reqs) -> None:
    for r in reqs:
        assert h.sched.admit(r).accepted
    h.run_until_idle()
    for r in reqs:
        for i in range(r.n):
            assert h.tokens[(r.key, i)] == expected_stream(h, r, i)[0]


def _first_seq(batch, req, index: int = 0):
    sid = req.seq_id
    return next((s.start_pos, len(s.token_ids), list(s.block_table)) for s in batch.seqs if s.seq_id == sid)


def test_repeat_prompt_reuses_full_blocks_and_prefills_only_the_rest():
    """A finished 10-token prompt leaves blocks 0 and 1 cached; the same prompt later takes them
    by reference and prefills only tokens 8-9 into a fresh block."""
    h = make_harness(num_blocks=8, block_size=4)
    a = make_request(1, P, max_tokens=3, ignore_eos=True, seed=1)
    _serve(h, a)
    assert h.sched.kv.bm.free_order() == [3, 4, 5, 6, 7, 2, 1, 0]  # a's table freed tail first, all full
    b = make_request(2, P, max_tokens=3, ignore_eos=True, seed=2)
    assert h.sched.admit(b).accepted
    batch = h.step()
    assert _first_seq(batch, b) == (8, 2, [0, 1, 3])
    assert h.sched.kv.bm.free_order() == [4, 5, 6, 7, 2]
    h.run_until_idle()
    assert h.tokens[(b.key, 0)] == expected_stream(h, b)[0]
    s = h.sched.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (20, 8)
    assert s.kv_blocks_free == 8


def test_diverging_prompt_hits_only_the_common_blocks():
    """A prompt sharing only the first block with a cached one reuses just that block."""
    h = make_harness(num_blocks=8, block_size=4)
    _serve(h, make_request(1, P, max_tokens=2, ignore_eos=True))
    c = make_request(2, P[:4] + [30, 31, 32, 33, 34], max_tokens=2, ignore_eos=True)
    assert h.sched.admit(c).accepted
    assert _first_seq(h.step(), c) == (4, 5, [0, 3, 4])
    h.run_until_idle()
    assert h.tokens[(c.key, 0)] == expected_stream(h, c)[0]


def test_block_aligned_prompt_still_computes_its_last_token():
    """An 8-token prompt fully cached hits one block only: the last block is recomputed so the
    request samples its first token from its own logits."""
    h = make_harness(num_blocks=8, block_size=4)
    _serve(h, make_request(1, P[:8], max_tokens=1, ignore_eos=True))
    b = make_request(2, P[:8], max_tokens=2, ignore_eos=True, seed=5)
    assert h.sched.admit(b).accepted
    start, count, table = _first_seq(h.step(), b)
    assert (start, count) == (4, 4) and table[0] in (0, 1) and len(table) == 2
    h.run_until_idle()
    assert h.tokens[(b.key, 0)] == expected_stream(h, b)[0]


def test_running_requests_share_cached_blocks_in_use():
    """A request joining while another with the same prompt decodes shares its full blocks (ref
    count 2) and needs only its own tail blocks from the pool."""
    h = make_harness(num_blocks=8, block_size=4)
    a = make_request(1, P, max_tokens=6, ignore_eos=True, seed=1)
    assert h.sched.admit(a).accepted
    h.step()
    b = make_request(2, P, max_tokens=6, ignore_eos=True, seed=2)
    assert h.sched.admit(b).accepted
    free_before = h.sched.kv.bm.num_free
    batch = h.step()
    assert _first_seq(batch, b) == (8, 2, [0, 1, 3])
    assert (h.sched.kv.bm.ref_count(0), h.sched.kv.bm.ref_count(1)) == (2, 2)
    assert h.sched.kv.bm.num_free == free_before - 1
    h.run_until_idle()
    for r in (a, b):
        assert h.tokens[(r.key, 0)] == expected_stream(h, r)[0]


def test_cancelling_a_sharer_keeps_the_other_requests_blocks():
    """Cancelling one of two requests sharing cached blocks drops only its references."""
    h = make_harness(num_blocks=8, block_size=4)
    a = make_request(1, P, max_tokens=8, ignore_eos=True, seed=1)
    b = make_request(2, P, max_tokens=8, ignore_eos=True, seed=2)
    assert h.sched.admit(a).accepted
    h.step()
    assert h.sched.admit(b).accepted
    h.step()
    assert h.sched.cancel(b.key)
    h.step()
    assert b.state == RequestState.CANCELLED and h.sched.kv.bm.ref_count(0) == 1
    h.run_until_idle()
    assert h.tokens[(a.key, 0)] == expected_stream(h, a)[0]
    assert h.sched.kv.bm.num_free == 8


def test_preempted_request_recomputes_from_its_own_cached_blocks():
    """The preempted request's full block stays cached; its recompute hits it and computes only
    the rest, and the stream continues unchanged."""
    h = make_harness(num_blocks=4, block_size=4)
    a = make_request(1, 4, max_tokens=6, ignore_eos=True, seed=11)
    b = make_request(2, 4, max_tokens=8, ignore_eos=True, seed=12)
    assert h.sched.admit(a).accepted and h.sched.admit(b).accepted
    for _ in range(5):
        h.step()
    batch = h.step()  # a needs a block at position 8: b is preempted, its block 1 parked
    assert b.state == RequestState.PREEMPTED and h.sched.kv.bm.cache.is_registered(1)
    batch = h.step()  # b rejoins: block 1 is a hit, 5 of its 9 tokens are recomputed
    assert _first_seq(batch, b) == (4, 5, [1, 3, 2])
    h.run_until_idle()
    for r in (a, b):
        assert h.tokens[(r.key, 0)] == expected_stream(h, r)[0]


def test_cache_salt_isolates_tenants():
    """The same prompt under another salt misses; under the same salt it hits."""
    h = make_harness(num_blocks=16, block_size=4)
    a = make_request(1, P, max_tokens=2, ignore_eos=True)
    a.cache_salt = "tenant-a"
    _serve(h, a)
    for rid, salt, hit in ((2, None, 0), (3, "tenant-b", 0), (4, "tenant-a", 8)):
        r = make_request(rid, P, max_tokens=2, ignore_eos=True)
        r.cache_salt = salt
        before = h.sched.stats().prefix_cache_hits
        _serve(h, r)
        assert h.sched.stats().prefix_cache_hits - before == hit


def test_colliding_hashes_never_share_blocks_between_different_prompts():
    """With a hash function that returns one value for everything, different prompts never read
    each other's blocks (their streams equal the reference) and an identical one still hits."""
    cfg = Config(queue_limit_s=1e6, block_size=4)
    bm = BlockManager(16, 4)
    bm.attach_cache(PrefixCache(16, 4, hash_fn=lambda parent, tokens: 7))
    h = Harness(sched=None, engine=FakeEngine(16, 4))  # type: ignore[arg-type]
    h.sched = Scheduler(cfg, bm, eos_token_ids={EOS}, clock=lambda: h.now, rng=random.Random(7))
    first = make_request(1, P, max_tokens=3, ignore_eos=True)
    _serve(h, first)
    rng = random.Random(3)
    for rid in range(2, 8):
        other = [rng.randrange(1, 40) for _ in range(10)]
        _serve(h, make_request(rid, other, max_tokens=3, ignore_eos=True, seed=rid))
    assert h.sched.stats().prefix_cache_hits == 0
    # one hash value means one registered block: P's first, parked and never evicted (the plain
    # free list always had room), so a prompt starting like P reuses exactly that block
    assert h.sched.stats().kv_blocks_cached == 1
    _serve(h, make_request(9, P[:4] + [1, 2, 3, 4, 5], max_tokens=3, ignore_eos=True))
    assert h.sched.stats().prefix_cache_hits == 4


def test_n_greater_than_one_starts_its_shared_prefix_from_cached_blocks():
    """n = 2 after the same prompt was served: sample 0 computes only tokens 8-9 behind the cached
    blocks [0, 1]; sample 1 joins a pass later, hits the same blocks, and both stream their
    reference tokens."""
    h = make_harness(num_blocks=16, block_size=4)
    _serve(h, make_request(1, P, max_tokens=2, ignore_eos=True))
    r = make_request(2, P, max_tokens=5, ignore_eos=True, n=2, seed=9)
    assert h.sched.admit(r).accepted
    assert _first_seq(h.step(), r)[:2] == (8, 2)
    second = h.sched.snapshot().live[r.key][1]
    start, count, table = _first_seq(h.step(), second)
    assert (start, count, table[:2]) == (8, 2, r.block_ids[:2]) and table[:2] == [0, 1]
    h.run_until_idle()
    for i in range(2):
        assert h.tokens[(r.key, i)] == expected_stream(h, r, i)[0]
    assert h.sched.stats().prefix_cache_hits == 2 * 8


def test_large_request_evicts_cached_blocks_and_cached_blocks_count_as_free():
    """Cached blocks are free for admission; a request needing the whole pool evicts them all."""
    h = make_harness(num_blocks=8, block_size=4)
    _serve(h, make_request(1, P, max_tokens=3, ignore_eos=True))
    s = h.sched.stats()
    assert (s.kv_blocks_free, s.kv_blocks_cached) == (8, 3)
    big = make_request(2, 29, max_tokens=3, ignore_eos=True)  # 32 tokens at most: all 8 blocks
    _serve(h, big)
    assert h.sched.stats().kv_blocks_free == 8


def test_caching_off_keeps_no_cache():
    """With prefix_caching=False nothing is cached and a repeat prompt is fully prefilled."""
    h = make_harness(num_blocks=8, block_size=4, prefix_caching=False)
    _serve(h, make_request(1, P, max_tokens=2, ignore_eos=True))
    b = make_request(2, P, max_tokens=2, ignore_eos=True)
    assert h.sched.admit(b).accepted
    assert _first_seq(h.step(), b)[:2] == (0, 10)
    s = h.sched.stats()
    assert (s.kv_blocks_cached, s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0, 0)


def test_equal_block_after_another_prefix_is_not_a_hit():
    """With a hash that ignores the parent, [3333][2222] finds [3333] cached, and a cached
    [2222] computed after [1111]: the parent check refuses that block (its keys depend on
    [1111]; the fake engine would fail the read), so only one block is reused."""
    cfg = Config(queue_limit_s=1e6, block_size=4)
    bm = BlockManager(16, 4)
    bm.attach_cache(PrefixCache(16, 4, hash_fn=lambda parent, tokens: hash(tokens)))
    h = Harness(sched=None, engine=FakeEngine(16, 4))  # type: ignore[arg-type]
    h.sched = Scheduler(cfg, bm, eos_token_ids={EOS}, clock=lambda: h.now, rng=random.Random(7))
    _serve(h, make_request(1, [1, 1, 1, 1, 2, 2, 2, 2, 5], max_tokens=2, ignore_eos=True))
    _serve(h, make_request(2, [3, 3, 3, 3, 9, 9, 9, 9, 5], max_tokens=2, ignore_eos=True))
    hits = h.sched.stats().prefix_cache_hits
    _serve(h, make_request(3, [3, 3, 3, 3, 2, 2, 2, 2, 6], max_tokens=2, ignore_eos=True))
    assert h.sched.stats().prefix_cache_hits - hits == 4


def test_with_caching_off_siblings_still_share_their_prompt_and_nobody_else_does():
    """prefix_caching=False: the samples of one n = 3 Submit share the prompt's full blocks (sample
    0 computes them once), a later request with the same prompt computes everything itself, and
    the prefix-cache metrics stay at zero (the feature is off)."""
    h = make_harness(num_blocks=32, block_size=4, prefix_caching=False)
    r = make_request(1, P, max_tokens=4, n=3, ignore_eos=True, seed=3)
    assert h.sched.admit(r).accepted
    samples = h.sched.snapshot().live[r.key]
    assert _first_seq(h.step(), r)[:2] == (0, 10)
    batch = h.step()
    assert [_first_seq(batch, s)[:2] for s in samples[1:]] == [(8, 2), (8, 2)]
    assert [s.block_ids[:2] for s in samples] == [[0, 1]] * 3 and h.sched.kv.bm.ref_count(0) == 3
    other = make_request(2, P, max_tokens=2, ignore_eos=True)
    assert h.sched.admit(other).accepted
    assert _first_seq(h.step(), other)[:2] == (0, 10)
    h.run_until_idle()
    for i in range(3):
        assert h.tokens[(r.key, i)] == expected_stream(h, r, i)[0]
    s = h.sched.stats()
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (0, 0) and s.kv_blocks_free == 32


def test_siblings_of_a_preempted_first_sample_wait_for_its_recompute():
    """Sample 0 preempted mid-prefill, before its prompt blocks are registered: its sibling stays
    held (and counted as waiting) until the recompute registers them; every stream is still the
    reference."""
    h = make_harness(num_blocks=9, block_size=4, max_rows=2, prefill_budget=1)
    a = make_request(1, 4, max_tokens=30, ignore_eos=True, seed=1)
    assert h.sched.admit(a).accepted
    h.step()
    r = make_request(2, P + P + P[:4], max_tokens=3, n=2, ignore_eos=True, seed=2)  # 24 tokens: 6 blocks
    assert h.sched.admit(r).accepted
    while not h.sched.stats().preemptions:
        h.step()
    assert r.is_waiting and r.num_computed == 0 and h.sched.stats().queue_depth == 2
    assert len(h.sched.snapshot().held) == 1
    h.run_until_idle()
    for req, n in ((a, 1), (r, 2)):
        for i in range(n):
            assert h.tokens[(req.key, i)] == expected_stream(h, req, i)[0]
