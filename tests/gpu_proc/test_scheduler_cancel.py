"""Cancellation, deadlines, and 400/429 through the scheduler."""

from ringserve.gpu_proc.request import RequestState
from tests.helpers.scheduler_fakes import expected_stream, make_harness, make_request


def _rows_in(batch):
    return {s.seq_id for s in batch.seqs}


def test_cancel_costs_at_most_one_step():
    """A cancel between steps: the very next batch leaves the row out, its blocks are free, the
    finish says cancelled, and the tokens it produced count as cancelled_tokens."""
    h = make_harness(num_blocks=16)
    a = make_request(1, 5, max_tokens=100, ignore_eos=True)
    b = make_request(2, 5, max_tokens=100, ignore_eos=True)
    h.sched.admit(a)
    h.sched.admit(b)
    for _ in range(4):
        h.step()
    assert h.sched.cancel(a.key, "disconnect")
    batch = h.step()
    assert a.seq_id not in _rows_in(batch) and b.seq_id in _rows_in(batch)
    assert h.finishes[(a.key, 0)].reason == "cancelled"
    assert len(h.tokens[(a.key, 0)]) == 4
    s = h.sched.stats()
    assert s.cancelled_tokens == 4 and s.running_rows == 1
    assert s.kv_blocks_free == 16 - len(b.block_ids)
    assert not h.sched.cancel(a.key)  # already gone


def test_cancel_while_in_flight_still_delivers_that_steps_token_then_stops():
    """A cancel arriving between schedule() and update(): that step's token is the last one."""
    h = make_harness(num_blocks=16)
    a = make_request(1, 5, max_tokens=100, ignore_eos=True)
    h.sched.admit(a)
    h.step()
    batch = h.sched.schedule(h.now)
    h.sched.cancel(a.key)
    h.sched.update(h.engine.run(batch))
    assert a.state == RequestState.DECODE
    assert h.step().seqs == [] and a.state == RequestState.CANCELLED


def test_queued_request_of_a_gone_client_is_dropped_before_prefill():
    """A cancelled queued request never appears in any batch and holds no blocks."""
    h = make_harness(num_blocks=16, max_rows=1)
    a = make_request(1, 5, max_tokens=5, ignore_eos=True)
    gone = make_request(2, 9, max_tokens=5, ignore_eos=True)
    h.sched.admit(a)
    h.sched.admit(gone)
    h.step()
    h.sched.cancel(gone.key, "disconnect")
    h.run_until_idle()
    assert all(gone.seq_id not in _rows_in(b) for b in h.batches)
    f = h.finishes[(gone.key, 0)]
    assert (f.reason, f.completion_tokens, f.ttft_ms) == ("cancelled", 0, 0.0)
    assert h.sched.stats().queue_depth == 0 and h.sched.stats().queued_gpu_seconds == 0


def test_stop_string_cancel_finishes_with_stop_and_wastes_nothing():
    """A worker's Cancel(reason='stop') ends the row with `stop` and is not cancelled work."""
    h = make_harness(num_blocks=16)
    a = make_request(1, 5, max_tokens=50, ignore_eos=True)
    h.sched.admit(a)
    h.step()
    h.step()
    h.sched.cancel(a.key, "stop")
    h.step()
    assert h.finishes[(a.key, 0)].reason == "stop" and h.sched.stats().cancelled_tokens == 0


def test_cancel_ends_every_sample_of_an_n_request():
    """All n samples finish with cancelled; shared blocks return once."""
    h = make_harness(num_blocks=64, block_size=4)
    r = make_request(1, 10, max_tokens=50, n=3, ignore_eos=True)
    assert h.sched.admit(r).accepted
    for _ in range(3):
        h.step()
    h.sched.cancel(r.key)
    h.step()
    assert [h.finishes[(r.key, i)].reason for i in range(3)] == ["cancelled"] * 3
    streamed = [len(h.tokens[(r.key, i)]) for i in range(3)]
    assert streamed == [3, 2, 2]  # sample 0 prefilled first; 1 and 2 joined on its cached blocks
    assert h.sched.stats().cancelled_tokens == sum(streamed) and h.sched.kv.bm.num_free == 64


def test_cancel_of_one_sample_ends_only_that_sample():
    """Cancel(index=1) (a stop string matched in sample 1) ends sample 1 with `stop` at the next
    pass and frees its blocks; the other samples run to their end."""
    h = make_harness(num_blocks=64, block_size=4)
    r = make_request(1, 10, max_tokens=6, n=3, ignore_eos=True)
    assert h.sched.admit(r).accepted
    for _ in range(3):
        h.step()
    second = h.sched.snapshot().live[r.key][1]
    assert h.sched.cancel(r.key, "stop", index=1)
    assert not h.sched.cancel(r.key, "stop", index=1) and not h.sched.cancel(r.key, index=7)
    h.step()
    assert h.finishes[(r.key, 1)].reason == "stop" and second.block_ids == []
    assert (r.key, 0) not in h.finishes and (r.key, 2) not in h.finishes
    h.run_until_idle()
    assert [h.finishes[(r.key, i)].reason for i in (0, 2)] == ["length", "length"]
    assert h.tokens[(r.key, 1)] == expected_stream(h, r, 1)[0][:2]
    assert h.sched.stats().cancelled_tokens == 0 and h.sched.kv.bm.num_free == 64


def test_passed_deadline_removes_running_and_queued_requests():
    """At the first pass after its deadline a request leaves with reason `deadline`."""
    h = make_harness(num_blocks=16, max_rows=1)
    a = make_request(1, 5, max_tokens=100, ignore_eos=True, deadline=h.now + 0.05)
    q = make_request(2, 5, max_tokens=100, ignore_eos=True, deadline=h.now + 0.02)
    h.sched.admit(a)
    h.sched.admit(q)
    h.step()  # now + 0.01
    h.step()  # + 0.02: q's deadline passed while it waited
    assert h.finishes[(q.key, 0)].reason == "deadline" and q.generated == []
    for _ in range(3):
        h.step()  # + 0.05: a leaves
    assert h.finishes[(a.key, 0)].reason == "deadline" and len(h.tokens[(a.key, 0)]) == 4
    assert not h.sched.has_work and h.sched.kv.bm.num_free == 16


def test_over_context_limit_is_400_and_never_queued():
    """prompt + max_tokens over the context limit is refused with 400 and leaves no trace."""
    h = make_harness(num_blocks=64, context_limit=64, max_tokens_limit=32)
    d = h.sched.admit(make_request(1, 40, max_tokens=25))
    assert d.status == 400 and d.code == "context_length_exceeded"
    assert not h.sched.has_work and h.sched.stats().queue_depth == 0


def test_request_larger_than_the_pool_is_400():
    """A request whose blocks could never fit the pool is refused up front, not stuck forever."""
    h = make_harness(num_blocks=4, block_size=4)
    assert h.sched.admit(make_request(1, 12, max_tokens=8)).code == "too_large_for_kv_pool"
    assert h.sched.admit(make_request(2, 12, max_tokens=4)).accepted


def test_queued_work_over_limit_is_429_with_retry_after():
    """Waiting work over queue_limit_s gives 429; the request that can start now is not waiting
    work. Retry-After is the projected time for the queue ahead to drain: the row frees when the
    one that starts now ends (300 expected tokens at the 1-row step of 1.25 ms), then the 1.925 s
    queued. Once the queue drains, the refused request is accepted."""
    h = make_harness(num_blocks=256, queue_limit_s=2.0, max_rows=1)
    # each: 100 prompt * 0.1 + 300 expected * 1.25 = 385 ms
    decisions = [h.sched.admit(make_request(i, 100, max_tokens=1000)) for i in range(7)]
    assert [d.status for d in decisions] == [200] * 6 + [429]
    assert decisions[6].retry_after_s == 3.0 and "retry after 3 s" in decisions[6].message
    assert h.sched.stats().queue_depth == 6
    assert abs(h.sched.stats().queued_gpu_seconds - 5 * 0.385) < 1e-9
    h.sched.admit(make_request(99, 1, max_tokens=1))  # cheap: still fits under the limit
    for k in range(6):
        h.sched.cancel((0, k))
    h.step()
    assert h.sched.admit(make_request(6, 100, max_tokens=1000)).accepted


def test_requests_that_can_start_now_are_never_refused_for_load():
    """An idle 32-row server takes 32 long requests at once, however costly each is priced (their
    prompts all fit in the next step); the 33rd is the first waiting work and is admitted too
    (nothing waited before it); the work behind it is refused. After a pass the 32 run and the
    queue holds only what waits, priced at all its 1,000 tokens (EOS ignored, no stop ids: it will
    generate them all)."""
    h = make_harness(num_blocks=4096, queue_limit_s=0.5, max_rows=32)
    decisions = [h.sched.admit(make_request(i, 20, max_tokens=1000, ignore_eos=True)) for i in range(40)]
    assert [d.status for d in decisions] == [200] * 33 + [429] * 7
    h.step()
    s = h.sched.stats()
    assert (s.running_rows, s.queue_depth) == (32, 1) and abs(
        s.queued_gpu_seconds - (20 * 0.1 + 1000 * 1.25) / 1000
    ) < 1e-6


def test_prefill_that_joined_requests_still_owe_is_work_ahead():
    """Issue 32: long prompts all "join at the next pass" while rows are free, but their chunks
    run one after another, so each waits for the prefill of those before it as for a queue. At
    0.1 ms a prompt token, 4,000-token prompts owe 400 ms each: the 5th would wait 1.6 s behind
    the first four and cost 0.41 s itself, over the 2 s limit: 429 with a Retry-After (before,
    all 20 were admitted, and the last waited 7.6 s for its first token)."""
    h = make_harness(num_blocks=8192, queue_limit_s=2.0, max_rows=32)
    decisions = [h.sched.admit(make_request(i, 4000, max_tokens=8)) for i in range(20)]
    assert [d.status for d in decisions] == [200] * 4 + [429] * 16
    assert decisions[4].retry_after_s is not None and decisions[4].retry_after_s >= 1
    h.sched.check_integrity()


def test_duplicate_key_is_refused():
    """A second live request with the same (worker, rid) is a 400, not a silent overwrite."""
    h = make_harness()
    assert h.sched.admit(make_request(1, 3)).accepted
    assert h.sched.admit(make_request(1, 3)).code == "duplicate_request"


def test_cancel_every_request_of_a_worker_via_live_keys():
    """live_keys() lists queued and running requests; cancelling a worker's keys ends only those."""
    h = make_harness(num_blocks=32, max_rows=2)
    reqs = [make_request(i, 4, max_tokens=50, worker=i % 2, ignore_eos=True) for i in range(4)]
    for r in reqs:
        h.sched.admit(r)
    h.step()
    assert sorted(h.sched.live_keys()) == sorted(r.key for r in reqs)
    for key in h.sched.live_keys():
        if key[0] == 1:
            h.sched.cancel(key)
    h.step()
    assert sorted(h.sched.live_keys()) == [(0, 0), (0, 2)]
    assert {k for (k, _), f in h.finishes.items() if f.reason == "cancelled"} == {(1, 1), (1, 3)}


def test_after_waiting_work_drains_requests_start_now_again():
    """Requests that waited (priced as waiting work) join and leave; the next requests on a free
    batch are again not waiting work: no leftover of the earlier prices blocks them."""
    h = make_harness(num_blocks=1024, max_rows=4)
    for i in range(12):  # 4 start now, 8 wait
        assert h.sched.admit(make_request(i, 7 + 3 * i, max_tokens=3 + i % 5, ignore_eos=True)).accepted
    assert h.sched.stats().queued_gpu_seconds > 0
    h.run_until_idle()
    for i in range(4):
        assert h.sched.admit(make_request(100 + i, 9, max_tokens=5)).accepted
    assert h.sched.stats().queued_gpu_seconds == 0


def test_held_siblings_keep_their_rows_reserved():
    """An n = 2 request that can start now holds two rows although sample 1 joins a pass later:
    two more requests start now, a fifth on a 4-row batch is waiting work."""
    h = make_harness(num_blocks=256, block_size=4, max_rows=4)
    r = make_request(1, 10, max_tokens=20, n=2, ignore_eos=True)
    assert h.sched.admit(r).accepted
    for i in (2, 3):
        assert h.sched.admit(make_request(i, 5, max_tokens=20, ignore_eos=True)).accepted
    assert h.sched.stats().queued_gpu_seconds == 0
    late = make_request(4, 5, max_tokens=20, ignore_eos=True)
    assert h.sched.admit(late).accepted
    assert h.sched.stats().queued_gpu_seconds > 0
    h.step()
    h.step()
    assert (h.sched.stats().running_rows, late.is_waiting) == (4, True)
