"""The scheduler's side of LoRA adapters (`Scheduler._adapter_waits`): rows of at most `max_loras`
adapters run at once, whatever the queue holds; the others wait, without preempting, until an
adapter's rows have left, and every request streams what it would alone. Each step marks its
adapter rows, and the stats count running and waiting requests per adapter."""

from __future__ import annotations

import dataclasses

from tests.helpers.scheduler_fakes import expected_stream, make_harness, make_request


def test_at_most_max_loras_adapters_run_and_every_request_finishes_exactly():
    h = make_harness(num_blocks=256, max_loras=2, lora_modules="a=/x b=/y c=/z")
    reqs = []
    for i in range(12):
        req = dataclasses.replace(make_request(i, 20, max_tokens=6 + i % 5, ignore_eos=True), lora=i % 4)
        assert h.sched.admit(req).accepted
        reqs.append(req)
    peak, waited = 0, False
    while h.sched.has_work:
        batch = h.step()  # check_integrity: at most max_loras adapters among the running rows
        adapters = {s.lora for s in batch.seqs if s.lora}
        peak = max(peak, len(adapters))
        assert batch.loras == bool(adapters)
        stats = h.sched.stats()
        waited |= any(stats.lora_waiting)
        assert sum(stats.lora_running) == sum(1 for r in reqs if r.is_running and r.lora)
    assert peak == 2 and waited and h.sched.preemptions == 0
    for req in reqs:
        assert h.tokens[(req.key, 0)] == expected_stream(h, req)[0]


def test_requests_of_running_adapters_join_past_one_that_waits_and_it_still_joins():
    """With both slots taken (adapters 1 and 2) a request of adapter 3 waits; the rows behind it of
    the base model and of adapter 2 join past it, adapter 1 (the fewer rows: drained) takes none,
    and adapter 3 joins as soon as adapter 1's rows have left."""
    h = make_harness(num_blocks=512, max_rows=16, max_loras=2, lora_modules="a=/x b=/y c=/z")

    def submit(i: int, lora: int, max_tokens: int):
        req = dataclasses.replace(make_request(i, 8, max_tokens=max_tokens, ignore_eos=True), lora=lora)
        assert h.sched.admit(req).accepted
        return req

    first = [submit(0, 1, 4), submit(1, 2, 40), submit(2, 2, 40)]
    h.step()
    assert all(r.is_running for r in first)
    waiter = submit(3, 3, 4)
    behind = [submit(4, 0, 4), submit(5, 2, 4), submit(6, 1, 4)]
    h.step()
    assert waiter.is_waiting and behind[0].is_running and behind[1].is_running
    assert behind[2].is_waiting  # adapter 1 is drained for adapter 3
    joined_at = None
    for step in range(20):
        h.step()
        if joined_at is None and waiter.is_running:
            joined_at = step
            assert not first[0].is_running and behind[2].is_waiting
    assert joined_at is not None and joined_at <= 6  # adapter 1's 4 tokens, not adapter 2's 40
    while h.sched.has_work:
        h.step()
    for req in first + [waiter] + behind:
        assert h.tokens[(req.key, 0)] == expected_stream(h, req)[0]


def test_a_request_whose_adapter_is_not_resident_is_priced_with_the_slot_fill():
    """What copying an adapter into a slot costs (measured by the registry, kept out of the step
    fit by the GPU loop) is added to the admission price of a request of a non-resident adapter."""
    h = make_harness(num_blocks=256, max_loras=2, lora_modules="a=/x b=/y")
    h.sched.lora_resident, h.sched.lora_swap_ms = frozenset({1}), 40.0
    prices = []
    for i, lora in enumerate((1, 2, 0)):
        req = dataclasses.replace(make_request(i, 20, max_tokens=6), lora=lora)
        decision = h.sched.admit(req)
        assert decision.accepted
        prices.append(decision.est_gpu_ms)
    assert prices[1] == prices[0] + 40.0 and prices[2] == prices[0]


def test_a_step_that_fills_a_slot_holds_the_fill_within_its_time_target():
    """A step whose prompt chunk needs its adapter copied into a slot first has the fill's ms taken
    from its time target: the chunk is cut shorter, and the estimate plus the fill stays within
    the target. Once resident, the adapter's chunks are the base model's size again."""
    from tests.gpu_proc.test_cost_model import calibration

    def chunk(resident: frozenset[int]) -> tuple[int, float]:
        h = make_harness(
            num_blocks=512, calibration=calibration(), prefill_budget=256, max_loras=2, lora_modules="a=/x"
        )
        h.sched.lora_resident, h.sched.lora_swap_ms = resident, 60.0
        h.sched.admit(dataclasses.replace(make_request(1, 400, max_tokens=2, ignore_eos=True), lora=1))
        h.step()
        return h.sched.last_shape.prefill, h.sched.costs.step_ms(h.sched.last_shape)

    (cold, cold_ms), (warm, warm_ms) = chunk(frozenset()), chunk(frozenset({1}))
    target = 125.0
    assert cold < warm and warm_ms <= target, (cold, warm)
    assert cold_ms + 60.0 <= target, cold_ms
