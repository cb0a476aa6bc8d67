"""The scheduler pass: leave -> join -> build one flat step, then fold the samples back in.

Pure bookkeeping, no torch: the GPU-process loop calls

    decision = sched.admit(request)        # per Submit: 400 / 429 / accepted (est_gpu_ms)
    sched.cancel(key, reason)              # per Cancel: a flag, read at the next step boundary
    batch = sched.schedule(now)            # a StepBatch for the runner (may be empty)
    events = sched.update(sample_output)   # TokenEvents and FinishEvents for the workers
    sched.observe_step_time(ms)            # feeds the admission cost model

Rules (the seed's steps 4-10):
- Leave: rows that sampled a stop token or reached max_tokens leave in `update` the moment they
  sample; cancelled requests and passed deadlines leave at the start of the next pass, queued or
  running. Their blocks go back to the free list.
- Join: while rows < `max_rows` and the free blocks cover the next request's tokens plus
  `admission_margin` of the pool (5 %), admit the fair choice (`fairness.py`). A joining request
  takes all the blocks its current tokens need; it then only grows one block every 16 tokens.
- Build: one token per decoding row, then prompt chunks (oldest request first) up to the prefill
  budget as one flat list. The budget rises when few rows decode: `prefill_budget * min(8,
  max_rows // decode_rows)`, never below `prefill_budget`, so the total stall the chunk imposes on
  decoding users (rows x extra step time) stays what it is at a full batch, and one step's prefill
  is at most 8 budgets.
- Preempt: when a decoding row needs a block and none is free, the most recently admitted running
  request is preempted: all its blocks are freed and it goes to the front of its key's queue. It is
  recomputed later (prompt plus tokens already produced) and resumes sampling where it stopped, so
  nothing is re-emitted and, with a seed, the output is unchanged.
- Prefix cache (`config.prefix_caching`): a joining request takes the longest verified run of
  cached full blocks for its tokens (n > 1: for the shared prefix) by reference and starts
  `num_computed` past them; at least the last token is always computed, so it samples. Blocks a
  step fills are registered when the step is built (its writes land before any later step reads).
  Cached free blocks count as free for the admission margin; a hit on one uses it up.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from ringserve.gpu_proc.admission import AdmissionController, Decision
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.fairness import FairQueue
from ringserve.gpu_proc.prefix_cache import PrefixCache, cached_prefix, register_filled
from ringserve.gpu_proc.request import FinishEvent, Request, RequestKey, RequestState, SampleRow, TokenEvent
from ringserve.gpu_proc.scheduler_checks import SchedulerIntegrityError, check_scheduler
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from ringserve.gpu_proc.stops import stop_reason

if TYPE_CHECKING:
    from ringserve.config import Config

__all__ = ["Scheduler", "SchedulerIntegrityError", "SchedulerStats"]

Event = TokenEvent | FinishEvent
_WASTED = ("cancelled", "deadline")  # finish reasons whose generated tokens count as cancelled_tokens


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """What the GPU process publishes to the control block every step."""

    queue_depth: int
    queued_gpu_seconds: float
    running_requests: int
    running_rows: int
    kv_blocks_free: int
    kv_blocks_total: int
    preemptions: int
    cancelled_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    c_prefill_ms: float
    c_decode_ms: float
    prefix_cache_queries: int = 0  # tokens looked up in the prefix cache at each join (recompute too)
    prefix_cache_hits: int = 0  # of those, tokens served from cached blocks
    kv_blocks_cached: int = 0  # free blocks still holding a cached prefix (part of kv_blocks_free)


class Scheduler:
    """Continuous batching over a paged KV cache: owns the queues and every block table."""

    def __init__(self, config: Config, block_manager: BlockManager, *, eos_token_ids=frozenset(),
                 clock: Callable[[], float] = time.time, rng: random.Random | None = None,
                 admission: AdmissionController | None = None) -> None:
        """`config` is a `ringserve.config.Config` (or any object with its scheduler fields). With
        `config.prefix_caching` the scheduler attaches a `PrefixCache` to the fresh `block_manager`
        unless it already has one (tests attach their own, e.g. with a colliding hash)."""
        if block_manager.block_size != config.block_size:
            raise ValueError(f"block manager has {block_manager.block_size}-token blocks, "
                             f"config says {config.block_size}")
        self.bm = block_manager
        self.block_size = block_manager.block_size
        if config.prefix_caching and block_manager.cache is None:
            namespace = config.model_name or config.model or ""
            block_manager.attach_cache(PrefixCache(block_manager.num_blocks, self.block_size, namespace=namespace))
        elif not config.prefix_caching and block_manager.cache is not None:
            raise ValueError("prefix caching is off in the config but the block manager has a cache")
        self.cache = block_manager.cache
        self.max_rows = config.max_rows
        self.prefill_budget = config.prefill_budget
        self.context_limit = config.context_limit
        self.margin_blocks = math.ceil(config.admission_margin * block_manager.num_blocks)  # seed: 358 of 7,152
        self.eos_token_ids = frozenset(eos_token_ids)
        self.queue = FairQueue(config.key_row_cap, config.output_token_weight)
        self.admission = admission or AdmissionController.from_config(config)
        self.clock = clock
        self._rng = rng or random.Random()
        self._live: dict[RequestKey, Request] = {}
        self._running: list[Request] = []  # ascending admit_seq: the newest is last
        self._running_rows = 0
        self._queued_ms = 0.0
        self._deadlines: list[tuple[float, int, Request]] = []
        self._cancels: list[Request] = []
        self._events: list[Event] = []
        self._sampling: list[tuple[Request, SampleRow]] = []  # rows sampling in the last batch
        self._next_seq_id = 0
        self._next_admit_seq = 0
        self._next_heap_seq = 0
        self.last_prefill_tokens = 0
        self.last_decode_rows = 0
        self.preemptions = 0
        self.cancelled_tokens = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- inputs ----------------------------------------------------------------------------------

    def admit(self, req: Request) -> Decision:
        """Price and queue `req`, or refuse it (400 can never run, 429 queue over its limit)."""
        if req.key in self._live:
            return Decision(400, code="duplicate_request", message=f"request {req.key} is already live")
        bs = self.block_size
        # Most blocks the request can ever hold at once: its longest row, plus for n > 1 each other
        # row's private tail and the prefix's partial block, held until the fork.
        worst = self.bm.blocks_for(req.prompt_len + req.max_tokens)
        if req.n > 1:
            worst += (req.n - 1) * (-(-req.max_tokens // bs) + 1) + 1
        decision = self.admission.decide(req.prompt_len, req.max_tokens, req.n, self._queued_ms,
                                         pool_fits=worst <= self.bm.num_blocks)
        if not decision.accepted:
            return decision
        sp = req.sampling
        seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        req.rows = [SampleRow(i, self._seq_id(), RowSampling(sp.temperature, sp.top_k, sp.top_p, seed, i, req.logprobs))
                    for i in range(req.n)]
        req.prefix_seq_id = self._seq_id() if req.n > 1 else -1
        req.est_gpu_ms = req.queued_est_ms = decision.est_gpu_ms
        req.state = RequestState.QUEUED
        self._queued_ms += req.queued_est_ms
        self._live[req.key] = req
        self.queue.push(req)
        self._next_heap_seq += 1
        heappush(self._deadlines, (req.deadline_ts, self._next_heap_seq, req))
        if len(self._deadlines) > 2 * len(self._live) + 64:
            # NOTE: a finished request leaves this heap only when its deadline comes (minutes);
            # without compaction the heap kept every request of the last request_timeout_s, prompts
            # and all, alive (the GPU process's RSS grew with the request rate). Amortized O(1).
            self._deadlines = [entry for entry in self._deadlines if not entry[2].is_finished]
            heapify(self._deadlines)
        return decision

    def cancel(self, key: RequestKey, reason: str = "cancelled") -> bool:
        """Flag a request to leave at the next step boundary; False if it is unknown or ending."""
        req = self._live.get(key)
        if req is None or req.cancel_reason is not None:
            return False
        req.cancel_reason = reason
        self._cancels.append(req)
        return True

    def observe_step_time(self, ms: float, prefill_tokens: int | None = None, decode_rows: int | None = None) -> None:
        """Feed one measured step (default: the counts of the last built batch) to the cost model."""
        self.admission.observe_step(ms, self.last_prefill_tokens if prefill_tokens is None else prefill_tokens,
                                    self.last_decode_rows if decode_rows is None else decode_rows)

    # -- the pass --------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepBatch:
        """Leave, join and build one step. The batch's block tables are the live lists: valid until
        the next call, and the runner must not change them."""
        now = self.clock() if now is None else now
        self._leave(now)
        self._join(now)
        return self._build()

    def update(self, samples=None) -> list[Event]:
        """Take the last batch's samples (`.token_ids`, `.logprobs`, `.top_logprobs`, one per
        sampling row in `batch.sampling_seqs` order; None for a batch with no sampling rows) and
        return every event since the last call, including the finishes the pass's leave phase made
        for cancelled and expired requests. Call it after every `schedule()`, even an empty one."""
        rows, self._sampling = self._sampling, []
        if samples is None:
            if rows:
                raise ValueError(f"the last batch has {len(rows)} sampling rows but no samples were given")
        else:
            token_ids, logprobs, tops = samples.token_ids, samples.logprobs, samples.top_logprobs
            if len(token_ids) != len(rows):
                raise ValueError(f"{len(token_ids)} samples for {len(rows)} sampling rows")
            self._apply_samples(rows, token_ids, logprobs, tops)
        events, self._events = self._events, []
        return events

    # -- leave -----------------------------------------------------------------------------------

    def _leave(self, now: float) -> None:
        if self._cancels:
            cancels, self._cancels = self._cancels, []
            for req in cancels:
                if not req.is_finished:
                    self._end(req, "stop" if req.cancel_reason == "stop" else "cancelled", now)
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            req = heappop(heap)[2]
            if not req.is_finished:
                self._end(req, "deadline", now)

    def _end(self, req: Request, reason: str, now: float) -> None:
        """Remove a queued or running request for good; finish every row still live."""
        live = req.live_rows
        if req.is_waiting:
            self.queue.remove(req)
            self._unqueue_cost(req)
        else:
            self._release_blocks(req)
            self._running.remove(req)
            self._running_rows -= len(live)
            self.queue.rows_ended(req.tenant, len(live))
        if reason in _WASTED:
            self.cancelled_tokens += req.num_generated
        for row in live:
            self._finish_row(req, row, reason, now)
        req.state = RequestState.DONE if reason == "stop" else RequestState.CANCELLED
        del self._live[req.key]

    # -- join ------------------------------------------------------------------------------------

    def _join(self, now: float) -> None:
        queue, bm = self.queue, self.bm
        while True:
            req = queue.peek()
            if req is None:
                return
            rows = len(req.live_rows)
            if self._running_rows + rows > self.max_rows:
                return
            hits = cached_prefix(self.cache, req) if self.cache is not None else []
            # a hit on a parked block uses up a free one; a hit on a block in use costs nothing
            need = self._blocks_to_join(req) - sum(1 for b in hits if bm.ref_count(b))
            free = bm.num_free
            # NOTE: an idle server admits a request that fits without the margin; otherwise a pool
            # smaller than one request plus the margin could never serve it.
            if free < need + self.margin_blocks and (self._running or free < need):
                return
            queue.rows_started(req.tenant, rows)  # first, so the key stays active across pop()
            queue.pop(req)
            self._unqueue_cost(req)
            self._allocate_on_join(req, hits)
            if req.admit_seq < 0:
                req.admit_seq = self._next_admit_seq
                self._next_admit_seq += 1
                req.first_join_ts = now
                self.prompt_tokens_total += req.prompt_len
                self._running.append(req)
            else:
                self._insert_running(req)
            req.state = RequestState.PREFILL
            self._running_rows += rows

    def _unqueue_cost(self, req: Request) -> None:
        self._queued_ms -= req.queued_est_ms
        req.queued_est_ms = 0.0
        if not len(self.queue):
            self._queued_ms = 0.0  # NOTE: no float residue once nothing waits

    def _blocks_to_join(self, req: Request) -> int:
        bm, plen = self.bm, req.prompt_len
        if req.n == 1:
            return bm.blocks_for(plen + len(req.rows[0].generated))
        full = req.prefix_len // self.block_size
        return bm.blocks_for(req.prefix_len) + sum(bm.blocks_for(plen + len(r.generated)) - full for r in req.live_rows)

    def _allocate_on_join(self, req: Request, hits: list[int]) -> None:
        bm, plen = self.bm, req.prompt_len
        if hits:
            bm.acquire(hits)
        if req.n == 1:
            row = req.rows[0]
            total = plen + len(row.generated)
            row.block_ids = hits + bm.allocate(bm.blocks_for(total) - len(hits))
            row.num_computed = len(hits) * self.block_size
            if self.cache is not None:
                self.cache.record(total, row.num_computed)
            return
        # n > 1: the prefix phase fills prompt[:-1] into prefix_blocks; rows share its full blocks
        # now and own the rest, including a private copy of the partial one (made at the fork).
        live = req.live_rows
        req.prefix_blocks, tables = bm.allocate_shared(req.prefix_len, [plen + len(r.generated) for r in live], hits)
        req.prefix_computed = len(hits) * self.block_size
        if self.cache is not None:
            self.cache.record(plen, req.prefix_computed)
        req.forked = False
        for row, table in zip(live, tables):
            row.block_ids = table
            row.num_computed = req.prefix_len

    def _insert_running(self, req: Request) -> None:
        running = self._running
        i = len(running)
        while i > 0 and running[i - 1].admit_seq > req.admit_seq:
            i -= 1
        running.insert(i, req)

    # -- build -----------------------------------------------------------------------------------

    def _build(self) -> StepBatch:
        bm, bs = self.bm, self.block_size
        seqs: list[SeqStep] = []
        copies: list[tuple[int, int]] = []
        sampling = self._sampling = []
        filled: list[tuple[SeqStep, Request, SampleRow | None]] = []  # seqs that fill a block up
        pending: list[tuple[Request, SampleRow | None]] = []  # prompt work, oldest request first
        running = self._running
        i = 0
        while i < len(running):
            req = running[i]
            marks = (len(seqs), len(sampling), len(pending), len(copies), len(filled))
            if req.n > 1 and not req.forked:
                if req.prefix_computed < req.prefix_len:
                    pending.append((req, None))
                    i += 1
                    continue
                self._fork(req, copies)
            prompt = req.prompt_ids
            plen = len(prompt)
            evicted_self = False
            for row in req.rows:
                if row.finish_reason is not None:
                    continue
                gen = row.generated
                p = row.num_computed
                if plen + len(gen) - p != 1:
                    pending.append((req, row))
                    continue
                blocks = row.block_ids
                if p // bs >= len(blocks):
                    while not bm.num_free:
                        victim = running[-1]
                        self._preempt(victim)
                        if victim is req:
                            evicted_self = True
                            break
                    if evicted_self:
                        break
                    blocks.append(bm.allocate_one())
                seqs.append(SeqStep(row.seq_id, [gen[-1] if gen else prompt[-1]], p, blocks, row.sampling))
                if (p + 1) % bs == 0:
                    filled.append((seqs[-1], req, row))
                sampling.append((req, row))
                row.num_computed = p + 1
            if evicted_self:
                # Undo what this pass gave the request; it was the newest, so nothing follows it.
                del seqs[marks[0]:], sampling[marks[1]:], pending[marks[2]:], copies[marks[3]:], filled[marks[4]:]
                break
            i += 1
        decode_rows = len(seqs)
        budget = self.prefill_budget_for(decode_rows)
        prefill_tokens = 0
        for req, row in pending:
            if budget <= 0:
                break
            if row is None:
                start = req.prefix_computed
                end = min(req.prefix_len, start + budget)
                seqs.append(SeqStep(req.prefix_seq_id, req.prompt_ids[start:end], start, req.prefix_blocks))
                if end // bs > start // bs:
                    filled.append((seqs[-1], req, None))
                req.prefix_computed = end
            else:
                start = row.num_computed
                total = req.prompt_len + len(row.generated)
                end = min(total, start + budget)
                samples = end == total
                seqs.append(SeqStep(row.seq_id, row.tokens(req.prompt_ids, start, end), start, row.block_ids,
                                    row.sampling if samples else None))
                if end // bs > start // bs:
                    filled.append((seqs[-1], req, row))
                if samples:
                    sampling.append((req, row))
                row.num_computed = end
            budget -= end - start
            prefill_tokens += end - start
            self.queue.charge(req.tenant, end - start, 0)
        self.last_prefill_tokens = prefill_tokens
        self.last_decode_rows = decode_rows
        if self.cache is not None and filled:
            register_filled(self.cache, filled)
        # NOTE: `sampling` was appended in lockstep with `seqs`, so it is in batch.sampling_seqs
        # order, which is the order of the runner's logits and the sampler's output.
        return StepBatch(seqs=seqs, block_copies=copies)

    def prefill_budget_for(self, decode_rows: int) -> int:
        """Prompt tokens allowed in a step with `decode_rows` decoding rows (see module doc)."""
        return self.prefill_budget * max(1, min(8, self.max_rows // max(decode_rows, 1)))

    def _fork(self, req: Request, copies: list[tuple[int, int]]) -> None:
        """The shared prefix is complete: copy its partial block for each row, drop the prefix's refs."""
        copies += self.bm.fork(req.prefix_blocks, req.prefix_len, [row.block_ids for row in req.live_rows])
        req.prefix_blocks = []
        req.forked = True

    # -- preemption ------------------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        """Free every block of `req` and queue it first for its key; it is recomputed later."""
        self._release_blocks(req)
        if self._running[-1] is req:
            self._running.pop()
        else:
            self._running.remove(req)
        live = req.live_rows
        for row in live:
            row.num_computed = 0
        req.prefix_computed = 0
        req.forked = False
        req.state = RequestState.PREEMPTED
        generated = max(len(r.generated) for r in live)
        req.queued_est_ms = self.admission.estimate_ms(req.prompt_len, req.max_tokens, len(live), generated)
        self._queued_ms += req.queued_est_ms
        self.queue.push_front(req)
        self.queue.rows_ended(req.tenant, len(live))
        self._running_rows -= len(live)
        self.preemptions += 1

    def _release_blocks(self, req: Request) -> None:
        bm = self.bm
        if req.prefix_blocks:
            bm.free(req.prefix_blocks)
            req.prefix_blocks = []
        for row in req.rows:
            if row.block_ids:
                bm.free(row.block_ids)
                row.block_ids = []

    # -- samples ---------------------------------------------------------------------------------

    def _apply_samples(self, rows, token_ids, logprobs, tops) -> None:
        now = self.clock()
        events = self._events
        eos, limit = self.eos_token_ids, self.context_limit
        charge = self.queue.charge
        for k, (req, row) in enumerate(rows):
            if row.finish_reason is not None:
                continue
            tok = int(token_ids[k])
            gen = row.generated
            gen.append(tok)
            if req.state == RequestState.PREFILL:
                req.state = RequestState.DECODE
                if req.first_token_ts is None:
                    req.first_token_ts = now  # TTFT ends here; a recompute does not restart it
            events.append(TokenEvent(req.key, row.index, tok, float(logprobs[k]),
                                     tops[k] if req.logprobs is not None else None))
            charge(req.tenant, 0, 1)
            sp = req.sampling
            reason = stop_reason(tok, len(gen), req.prompt_len + len(gen), eos_token_ids=eos,
                                 stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                                 max_tokens=req.max_tokens, context_limit=limit)
            self.generation_tokens_total += 1
            if reason is not None:
                self._row_done(req, row, reason, now)

    def _row_done(self, req: Request, row: SampleRow, reason: str, now: float) -> None:
        """A row sampled its last token: its blocks go back now, the request when all rows are done."""
        self.bm.free(row.block_ids)
        row.block_ids = []
        self._running_rows -= 1
        self.queue.rows_ended(req.tenant, 1)
        self.admission.observe_answer(len(row.generated))
        self._finish_row(req, row, reason, now)
        if all(r.finish_reason is not None for r in req.rows):
            if req.prefix_blocks:
                self.bm.free(req.prefix_blocks)
                req.prefix_blocks = []
            self._running.remove(req)
            req.state = RequestState.DONE
            del self._live[req.key]

    def _finish_row(self, req: Request, row: SampleRow, reason: str, now: float) -> None:
        row.finish_reason = reason
        joined = req.first_join_ts if req.first_join_ts is not None else now
        ttft = (req.first_token_ts - req.arrival_ts) * 1000.0 if req.first_token_ts is not None else 0.0
        self._events.append(FinishEvent(req.key, row.index, reason, req.prompt_len, len(row.generated),
                                        max(0.0, (joined - req.arrival_ts) * 1000.0), max(0.0, ttft)))

    # -- views -----------------------------------------------------------------------------------

    def _seq_id(self) -> int:
        self._next_seq_id += 1
        return self._next_seq_id

    @property
    def has_work(self) -> bool:
        """Anything queued or running (the loop sleeps on its doorbell when not)."""
        return bool(self._live)

    @property
    def running(self) -> list[Request]:
        return self._running

    def get(self, key: RequestKey) -> Request | None:
        return self._live.get(key)

    def live_keys(self) -> list[RequestKey]:
        """Keys of every queued or running request (a copy: safe to cancel while iterating)."""
        return list(self._live)

    def stats(self) -> SchedulerStats:
        cache = self.cache
        return SchedulerStats(
            queue_depth=len(self.queue), queued_gpu_seconds=max(self._queued_ms, 0.0) / 1000.0,
            running_requests=len(self._running), running_rows=self._running_rows,
            kv_blocks_free=self.bm.num_free, kv_blocks_total=self.bm.num_blocks,
            preemptions=self.preemptions, cancelled_tokens=self.cancelled_tokens,
            prompt_tokens_total=self.prompt_tokens_total, generation_tokens_total=self.generation_tokens_total,
            c_prefill_ms=self.admission.costs.c_prefill_ms, c_decode_ms=self.admission.costs.c_decode_ms,
            prefix_cache_queries=cache.queries if cache is not None else 0,
            prefix_cache_hits=cache.hits if cache is not None else 0, kv_blocks_cached=self.bm.num_cached)

    def check_integrity(self) -> None:
        """Raise SchedulerIntegrityError unless every block table, row count, queue, cached block
        and account agrees with the others (tests run it after every step; cheap enough when idle)."""
        check_scheduler(self)

