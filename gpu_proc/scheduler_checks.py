"""The scheduler's integrity check: every book it keeps agrees with every other.

Tests run it after every step; it is cheap enough to run when the GPU process is idle. It covers
block tables against reference counts, running rows, the fair queue's accounts, and with a prefix
cache: free + cached + in use == total, unique hashes, and that every cached block a table reads
holds exactly the tokens the row expects there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ringserve.gpu_proc.scheduler import Scheduler


def check_scheduler(sched: Scheduler) -> None:
    """Raise SchedulerIntegrityError at the first disagreement (see the module docstring)."""
    expected: dict[int, int] = {}
    rows_by_key: dict[str, int] = {}
    rows = 0
    bs = sched.block_size
    for k, req in enumerate(sched._running):
        _require(req.is_running, f"{req.key} is in the running list in state {req.state.name}")
        _require(k == 0 or sched._running[k - 1].admit_seq < req.admit_seq, "running list out of admission order")
        _require(sched._live.get(req.key) is req, f"running {req.key} is not live")
        for b in req.prefix_blocks:
            expected[b] = expected.get(b, 0) + 1
        for row in req.rows:
            if row.finish_reason is not None:
                _require(not row.block_ids, f"{req.key}#{row.index} finished but holds blocks")
                continue
            rows += 1
            for b in row.block_ids:
                expected[b] = expected.get(b, 0) + 1
            _require(len(row.block_ids) * bs >= row.num_computed,
                     f"{req.key}#{row.index}: {row.num_computed} tokens computed in {len(row.block_ids)} blocks")
        rows_by_key[req.tenant] = rows_by_key.get(req.tenant, 0) + len(req.live_rows)
    sched.bm.check_integrity(expected)
    for req in sched._running:
        if req.n > 1 and not req.forked:
            continue
        for row in req.live_rows:  # a block a row will write into must be its alone
            for b in row.block_ids[row.num_computed // bs:]:
                _require(sched.bm.ref_count(b) == 1, f"{req.key}#{row.index} would write shared block {b}")
    _require(rows == sched._running_rows, f"running_rows {sched._running_rows}, block tables say {rows}")
    _require(rows <= sched.max_rows, f"{rows} rows running over the cap of {sched.max_rows}")
    try:
        sched.queue.check_integrity(rows_by_key)
    except ValueError as exc:
        raise SchedulerIntegrityError(str(exc)) from None
    waiting = list(sched.queue.waiting())
    for req in waiting:
        _require(not req.prefix_blocks and all(not r.block_ids for r in req.rows), f"queued {req.key} holds blocks")
    _require(len(waiting) + len(sched._running) == len(sched._live), "live requests are neither queued nor running")
    queued = sum(r.queued_est_ms for r in waiting)
    _require(abs(queued - sched._queued_ms) <= 1e-6 * max(1.0, queued), "queued_gpu_ms drifted from its requests")
    if sched.cache is not None:
        _check_cached_tables(sched)


def _check_cached_tables(sched: Scheduler) -> None:
    """Every registered block in a live table holds the tokens that table expects at its index."""
    cache, bs = sched.cache, sched.block_size
    for req in sched.running:
        tables = []
        if req.prefix_blocks:
            tables.append((req.prefix_blocks, req.prompt_ids[:req.prefix_computed]))
        for row in req.live_rows:
            tables.append((row.block_ids, row.tokens(req.prompt_ids, 0, row.num_computed)))
        for blocks, known in tables:
            for j, b in enumerate(blocks[:len(known) // bs]):
                e = cache.entry(b)
                _require(e is None or list(e.tokens) == known[j * bs:(j + 1) * bs],
                         f"{req.key}: cached block {b} at index {j} holds other tokens")


class SchedulerIntegrityError(RuntimeError):
    """The scheduler's books disagree: a bug that would leak blocks or mix requests' caches."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SchedulerIntegrityError(message)
