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
