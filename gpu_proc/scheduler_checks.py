"""The scheduler's integrity check: every book it keeps agrees with every other.

Tests run it after every step (between `update` and the next `schedule`, when no draft is in
flight); it is cheap enough to run when the GPU process is idle. It reads
the scheduler's public `snapshot()` and covers block tables against reference counts, running
rows, the fair queue's accounts, the waiting-work total, admission's online estimates (finite, positive, bounded), and the prefix cache: free + cached + in
use == total, unique hashes, and that every cached block a table reads holds exactly the tokens
the request expects there.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ringserve.gpu_proc.admission import AdmissionController, AdmissionLedger
    from ringserve.gpu_proc.fairness import FairQueue
    from ringserve.gpu_proc.kv_manager import KVCacheManager
    from ringserve.gpu_proc.request import Request, WorkerRid


@dataclass(frozen=True)
class SchedulerSnapshot:
    """The scheduler's books at one moment (`Scheduler.snapshot()`); read, never change them."""

    running: tuple[Request, ...]  # admission order
    queued: tuple[Request, ...]  # in the fair queue
    held: tuple[Request, ...]  # siblings waiting for sample 0's prompt blocks
    live: Mapping[WorkerRid, tuple[Request, ...]]  # every sample of every live Submit
    ledger: AdmissionLedger  # waiting work per tenant; rows and blocks reserved to start now
    max_rows: int
    kv: KVCacheManager
    queue: FairQueue
    admission: AdmissionController
    max_loras: int = 0  # distinct LoRA adapters the running rows may hold (0: no cap checked)


def check_scheduler(snap: SchedulerSnapshot) -> None:
    """Raise SchedulerIntegrityError at the first disagreement (see the module docstring)."""
    bm, bs = snap.kv.bm, snap.kv.block_size
    expected: dict[int, int] = {}
    rows_by_tenant: dict[str, int] = {}
    for k, req in enumerate(snap.running):
        name = f"{req.key}#{req.index}"
        _require(req.is_running, f"{name} is in the running list in state {req.state.name}")
        _require(k == 0 or snap.running[k - 1].admit_seq < req.admit_seq, "running list out of admission order")
        _require(req in snap.live.get(req.key, ()), f"running {name} is not live")
        _require(
            len(req.block_ids) * bs >= req.num_computed,
            f"{name}: {req.num_computed} tokens computed in {len(req.block_ids)} blocks",
        )
        _require(
            len(req.block_ids) <= snap.kv.blocks_for(req.num_tokens),
            f"{name}: {len(req.block_ids)} blocks for {req.num_tokens} tokens (a rejected draft's kept?)",
        )
        for b in req.block_ids:
            expected[b] = expected.get(b, 0) + 1
        rows_by_tenant[req.tenant] = rows_by_tenant.get(req.tenant, 0) + 1
    bm.check_integrity(expected)
    for req in snap.running:  # a block a request will write into must be its alone
        for b in req.block_ids[req.num_computed // bs :]:
            _require(bm.ref_count(b) == 1, f"{req.key}#{req.index} would write shared block {b}")
    _require(len(snap.running) <= snap.max_rows, f"{len(snap.running)} rows running over the cap of {snap.max_rows}")
    adapters = {r.lora for r in snap.running if r.lora}
    _require(
        not snap.max_loras or len(adapters) <= snap.max_loras,
        f"{len(adapters)} LoRA adapters running over the {snap.max_loras} resident slots",
    )
    try:
        snap.queue.check_integrity(rows_by_tenant)
    except ValueError as exc:
        raise SchedulerIntegrityError(str(exc)) from None
    _check_waiting(snap)
    _check_cached_tables(snap)
    problem = snap.admission.problem()
    _require(problem is None, f"admission's cost model: {problem}")


def _check_waiting(snap: SchedulerSnapshot) -> None:
    """Queued and held requests hold no blocks, every live sample is in exactly one place, the
    waiting-work total is the sum of its requests, and reservations match what starts now."""
    waiting = snap.queued + snap.held
    for req in waiting:
        _require(not req.block_ids, f"waiting {req.key}#{req.index} holds blocks")
    unfinished = [r for samples in snap.live.values() for r in samples if not r.is_finished]
    _require(
        len(waiting) + len(snap.running) == len(unfinished) == len({id(r) for r in unfinished}),
        "live requests are neither queued, held nor running (or in two places)",
    )
    want: dict[str, tuple[float, int]] = {}
    for r in waiting:
        if r.queued_est_ms:
            ms, count = want.get(r.tenant, (0.0, 0))
            want[r.tenant] = (ms + r.queued_est_ms, count + 1)
    books = snap.ledger.waiting_by_tenant()
    _require(set(books) == set(want), f"tenants with waiting work {sorted(books)}, their requests say {sorted(want)}")
    for tenant, (ms, count) in books.items():
        _require(
            math.isfinite(ms) and abs(ms - want[tenant][0]) <= 1e-6 * max(1.0, ms) and count == want[tenant][1],
            f"tenant {tenant!r}: waiting work {ms} ms over {count} requests, its requests say {want[tenant]}",
        )
    starting = snap.ledger.starting
    for req in starting:
        _require(
            req.starts_now and req.is_waiting and req.queued_est_ms == 0.0,
            f"{req.key}#{req.index} is reserved to start but is not a waiting request at no cost",
        )
    blocks = sum(snap.kv.blocks_for(r.prompt_len) for r in starting)
    reserved = snap.ledger.reserved_blocks
    _require(reserved == blocks, f"{reserved} blocks reserved, starting requests need {blocks}")


def _check_cached_tables(snap: SchedulerSnapshot) -> None:
    """Every registered block in a live table holds the tokens that table expects at its index."""
    cache, bs = snap.kv.cache, snap.kv.block_size
    for req in snap.running:
        known = req.tokens(0, req.num_computed)
        for j, b in enumerate(req.block_ids[: len(known) // bs]):
            e = cache.entry(b)
            _require(
                e is None or list(e.tokens) == known[j * bs : (j + 1) * bs],
                f"{req.key}#{req.index}: cached block {b} at index {j} holds other tokens",
            )


class SchedulerIntegrityError(RuntimeError):
    """The scheduler's books disagree: a bug that would leak blocks or mix requests' caches."""


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise SchedulerIntegrityError(message)
