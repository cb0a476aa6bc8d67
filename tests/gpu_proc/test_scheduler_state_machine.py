"""Hypothesis state machine: random submits, cancels, deadlines and steps on tiny pools that force
preemption. After every step the books balance (check_integrity); at the end every block is free
and every stream equals what the request produces alone (or a prefix of it, when cut short).

Prompts often start with one of a few shared prefixes (some under a cache salt), so the prefix
cache hits, shares blocks between running requests, parks and evicts them under preemption; the
fake engine reads every context back through the block table, so a wrong hit changes a stream.
"""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.prefix_cache import PrefixCache
from ringserve.gpu_proc.scheduler import Scheduler
from tests.helpers.scheduler_fakes import EOS, VOCAB, expected_stream, make_harness, make_request

NUM_BLOCKS = 20
# the last shares its second block with the second: equal tokens after different parents
SHARED = ([], [3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8, 5, 9, 2, 6])


class SchedulerMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.h = make_harness(num_blocks=NUM_BLOCKS, block_size=4, max_rows=8, prefill_budget=8, key_row_cap=2)
        self.accepted = []
        self.samples = {}  # key -> every sample of the Submit
        self.next_rid = 0

    @rule(
        tenant=st.sampled_from("abc"),
        shared=st.sampled_from(SHARED),
        prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=24),
        max_tokens=st.integers(1, 32),
        n=st.integers(1, 3),
        seed=st.integers(0, 2**32),
        ignore_eos=st.booleans(),
        ttl=st.sampled_from([None, None, None, None, 0.03, 0.3]),
        salt=st.sampled_from([None, None, "s"]),
    )
    def submit(self, tenant, shared, prompt, max_tokens, n, seed, ignore_eos, ttl, salt):
        self.next_rid += 1
        prompt = (shared + prompt)[:24]
        deadline = 1e12 if ttl is None else self.h.now + ttl
        req = make_request(
            self.next_rid,
            prompt,
            max_tokens,
            tenant=tenant,
            n=n,
            seed=seed,
            ignore_eos=ignore_eos,
            deadline=deadline,
            worker=self.next_rid % 3,
        )
        req.cache_salt = salt
        d = self.h.sched.admit(req)
        if d.accepted:
            self.accepted.append(req)
            self.samples[req.key] = self.h.sched.snapshot().live[req.key]
        else:
            assert d.status == 400 and d.code == "too_large_for_kv_pool"

    @precondition(lambda self: self.accepted)
    @rule(
        pick=st.integers(0, 10**6),
        reason=st.sampled_from(["cancelled", "disconnect", "stop"]),
        index=st.sampled_from([None, None, 0, 1, 2]),
    )
    def cancel(self, pick, reason, index):
        """Cancel a whole Submit, or one sample of it (a stop string in that sample)."""
        req = self.accepted[pick % len(self.accepted)]
        targets = self.samples[req.key] if index is None else self.samples[req.key][index : index + 1]
        fresh = any(not s.is_finished and s.cancel_reason is None for s in targets)
        assert self.h.sched.cancel(req.key, reason, index) == fresh  # a second cancel is a no-op

    @rule(count=st.integers(1, 4))
    def step(self, count):
        for _ in range(count):
            self.h.step()

    @invariant()
    def books_balance(self):
        self.h.sched.check_integrity()

    def teardown(self):
        h = self.h
        h.run_until_idle(max_steps=5000)
        assert h.sched.kv.bm.num_free == NUM_BLOCKS
        s = h.sched.stats()
        assert (s.running_rows, s.queue_depth, s.queued_gpu_seconds) == (0, 0, 0)
        for req in self.accepted:
            for i, sample in enumerate(self.samples[req.key]):
                got = h.tokens.get((req.key, i), [])
                fin = h.finishes[(req.key, i)]
                want, reason = expected_stream(h, req, i)
                assert fin.completion_tokens == len(got)
                if fin.reason in ("cancelled", "deadline") or (fin.reason == "stop" and sample.cancel_reason == "stop"):
                    assert got == want[: len(got)]
                else:
                    assert (got, fin.reason) == (want, reason)


SchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestSchedulerMachine = SchedulerMachine.TestCase


class CollidingHashMachine(SchedulerMachine):
    """The same machine with a prefix cache whose hash ignores the parent and has eight values:
    lookups collide often, and only the token and parent checks keep other prompts' blocks out
    (the streams prove it)."""

    def __init__(self):
        super().__init__()
        h = self.h
        bm = BlockManager(NUM_BLOCKS, 4)
        bm.attach_cache(PrefixCache(NUM_BLOCKS, 4, hash_fn=lambda parent, tokens: hash(tokens) % 8))
        h.sched = Scheduler(
            Config(queue_limit_s=1e6, block_size=4, max_rows=8, prefill_budget=8, key_row_cap=2),
            bm,
            eos_token_ids={EOS},
            clock=lambda: h.now,
            rng=random.Random(7),
        )


CollidingHashMachine.TestCase.settings = settings(
    max_examples=30, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestCollidingHashMachine = CollidingHashMachine.TestCase


def test_state_machine_shared_prefixes_hit_the_cache():
    """The machine's shared prefixes really produce cache hits, also across preemption."""
    h = make_harness(num_blocks=NUM_BLOCKS, block_size=4, max_rows=8, prefill_budget=8, key_row_cap=2)
    for i in range(6):
        req = make_request(i, SHARED[2] + [i + 1], max_tokens=20, ignore_eos=True, n=1 + i % 2, seed=i)
        assert h.sched.admit(req).accepted
        h.step()
    h.run_until_idle()
    s = h.sched.stats()
    assert s.prefix_cache_hits > 0 and s.preemptions > 0 and h.sched.kv.bm.num_free == NUM_BLOCKS


def test_state_machine_forces_preemptions():
    """The machine's pool is small enough that preemption really happens in these runs."""
    h = make_harness(num_blocks=NUM_BLOCKS, block_size=4, max_rows=8, prefill_budget=8, key_row_cap=2)
    for i in range(6):
        assert h.sched.admit(make_request(i, 10, max_tokens=20, ignore_eos=True, n=1 + i % 2, seed=i)).accepted
    h.run_until_idle()
    assert h.sched.stats().preemptions > 0 and h.sched.kv.bm.num_free == NUM_BLOCKS
