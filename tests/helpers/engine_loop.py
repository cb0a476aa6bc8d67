"""The GPU loop's pass without rings, for tests that drive the real engine under the scheduler."""

from __future__ import annotations

from ringserve.shm.messages import Token


def serve_until_idle(sched, engine, out: dict[tuple[int, int], list[int]], max_steps: int = 2000) -> None:
    """Schedule, run and update until nothing is queued or running, checking the scheduler's books
    after every step; appends each sample's tokens to `out[(rid, index)]`."""
    for _ in range(max_steps):
        if not sched.has_work:
            return
        batch = sched.schedule()
        samples = engine.step(batch) if batch.seqs else None
        for _, ev in sched.update(samples):
            if isinstance(ev, Token):
                out.setdefault((ev.rid, ev.index), []).append(ev.token_id)
        sched.check_integrity()
    raise AssertionError(f"still busy after {max_steps} steps")
