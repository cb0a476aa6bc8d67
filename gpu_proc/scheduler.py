"""The scheduler pass: leave -> join -> build one flat step, then fold the samples back in.

Pure bookkeeping, no torch: the GPU-process loop calls

    decision = sched.admit(request)         # per Submit: 400 / 429 / accepted (est_gpu_ms)
    sched.cancel(key, reason, index)        # per Cancel: a flag, read at the next step boundary
    batch = sched.schedule(now)             # a StepBatch for the runner (may be empty)
    events = sched.update(sample_output)    # (worker slot, Token | Finish | PromptLogprobs | Pooled) records
    sched.observe_step_time(ms)             # feeds the step cost model

Rules (`docs/design.md#scheduler-pass`):
- Admit (`#admission`): a request that can join at the next pass (a free row, blocks for its
  tokens plus the margin, nothing else waiting, and no more prefill ahead of it than one step
  holds) is not waiting work and is never refused for load; the rest is priced by the step cost
  model, and refused with 429 once the work ahead of it passes `queue_limit_s` (its tenant's
  queue and the prefill its joined requests still owe and, of each other tenant's, up to as much:
  `AdmissionLedger.ahead_ms`), so one tenant's flood never refuses another. A Submit
  with `n` samples becomes `n` sibling requests.
- Leave: requests that sampled a stop token or reached max_tokens leave in `update` the moment
  they sample; cancelled requests and passed deadlines leave at the start of the next pass, queued
  or running. Their blocks go back to the free list.
- Join: while a row is free and the free blocks cover the next request's tokens plus
  `admission_margin` of the pool (5 %), admit the fair choice (`fairness.py`). The KV manager
  (`kv_manager.py`: the only owner of blocks; this file never sees a block size) gives it every
  block its current tokens need, prefix-cache hits first (`#prefix-cache`); each step then asks
  it for the slots of the tokens it feeds the request.
- Fair preemption (`#fairness`): when the fair choice cannot join, its tenant is below its fair
  share of rows and it has waited more than `fair_preempt_steps` passes (or as long as that many
  steps at the step target take, where passes run long), the newest request of the
  tenant most over its share is preempted for it. So the head request of a tenant below its share
  joins at most `fair_preempt_steps + 1` passes after it arrives, however the batch is held.
- Build: one token per decoding request, then prompt chunks as one flat list, the chunks of
  tenants holding fewer rows first, then oldest first (so a request that fair preemption just
  started is not held behind another tenant's prefills), all drawn from the step's budget
  (`step_budget.py`): prompt tokens (the budget rises when few rows decode) and time, the
  step's estimated ms held to `step_target_ms` by cutting the chunks (the first chunk always
  gets `MIN_CHUNK_TOKENS`, so every step makes progress). The batch names the sequences that
  ended since the last one, so the engine frees their per-sequence state at once.
- Preempt (`#preemption`): when a decoding request needs a block and none is free, the most
  recently admitted running request of the tenant holding the most blocks is preempted: its blocks
  are freed and it goes to the front of its tenant's queue. It is recomputed later (prompt plus tokens already produced) and resumes
  sampling where it stopped, so nothing is re-emitted and, with a seed, the output is unchanged.
- Prompt logprobs (`#sampling`, `prompt_chunks.py`): a request that asks for them scores its
  prompt in the prefill chunks it runs anyway, within the step budget's scoring allowance, and
  takes no prefix-cache hits until its prompt is scored (a cached block has no logits).
- Siblings (`#sampling`, `siblings.py`): sample 0 of an n > 1 Submit joins first; the others are
  queued once its prompt's full blocks are registered, and find them in the prefix cache, so the
  prompt is computed once. Blocks a step fills are registered when the step is built
  (`kv.commit()`): its writes land before any later step reads them.
- Paused rows (`#structured-output`, `grammar.py`): a sampling row whose grammar mask was not
  ready emits nothing; `num_computed` goes back before its last real token (a draft's slots are
  freed, a block that token completed is forgotten by the prefix cache), so it is computed again.
- Speculation (`#speculative-decoding`, `speculation.py`): a decoding row also gets a draft from
  its own tokens where each draft token's chance of being kept beats what the step already
  yields per millisecond (the cost model's fitted step times say what a token costs), with slots that are never registered (`kv.allocate_draft_slots`; a draft never preempts and
  never takes the margin). `update` keeps the longest agreeing prefix plus the token after it,
  rolls `num_computed` back to what was kept, and `kv.accept_draft` registers the blocks the
  kept tokens filled and frees the ones only rejected tokens reached.
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Callable, Sequence
from heapq import heapify, heappop, heappush
from typing import TYPE_CHECKING

from ringserve.gpu_proc.admission import AdmissionController, AdmissionLedger, Decision, retry_after_s
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.cost_model import Sample, StepAudit
from ringserve.gpu_proc.fairness import FairQueue
from ringserve.gpu_proc.kv_manager import KVCacheManager
from ringserve.gpu_proc.prompt_chunks import PromptPooler, PromptScorer
from ringserve.gpu_proc.request import Request, RequestState, WorkerRid
from ringserve.gpu_proc.scheduler_checks import SchedulerIntegrityError, SchedulerSnapshot, check_scheduler
from ringserve.gpu_proc.scheduler_stats import SchedulerStats
from ringserve.gpu_proc.siblings import Siblings
from ringserve.gpu_proc.speculation import Speculator, StepYield, accepted_prefix
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_budget import StepBudget, prefill_tokens_for
from ringserve.gpu_proc.step_shape import StepShape, chunk_reads
from ringserve.gpu_proc.tenant_book import TenantBook
from ringserve.rules import finish_reason
from ringserve.shm.messages import CancelReason, Finish, FinishReason, Pooled, PromptLogprobs, Token

if TYPE_CHECKING:
    from ringserve.config import Config

__all__ = ["Scheduler", "SchedulerIntegrityError", "SchedulerStats"]

Event = tuple[int, Token | Finish | PromptLogprobs | Pooled]  # (worker slot, the record for its StepOutput)


class Scheduler:
    """Continuous batching over a paged KV cache: owns the queues and every request's blocks."""

    def __init__(
        self,
        config: Config,
        block_manager: BlockManager,
        *,
        eos_token_ids=frozenset(),
        clock: Callable[[], float] = time.time,
        rng: random.Random | None = None,
        admission: AdmissionController | None = None,
        calibration: Sequence[Sample] = (),
    ) -> None:
        """`config` is a `ringserve.config.Config` (or any object with its scheduler fields);
        `calibration`: the start-up calibration's timed steps, the cost model's prior."""
        if block_manager.block_size != config.block_size:  # NOTE: the one look at a block size here
            raise ValueError(
                f"block manager has {block_manager.block_size}-token blocks, config says {config.block_size}"
            )
        self.kv = KVCacheManager(
            block_manager, caching=config.prefix_caching, namespace=config.model_name or config.model or ""
        )
        self.max_rows = config.max_rows
        self.max_loras = config.max_loras  # distinct LoRA adapters among the running rows
        self.tenants = TenantBook(config.metrics_tenants)  # per-tenant counts for /metrics
        # adapter id -> its stats index (lora_running_<i>), set by the GPU loop from the LoRA registry
        # (`lora.LoraRegistry.index`); at start the --lora-modules ids 1..N in order
        self.lora_index: dict[int, int] = {i + 1: i for i in range(len(config.loras))}
        self._draining: int | None = None  # the adapter taking no new rows, for one that waits (_join)
        self._lora_done: dict[int, list[int]] = {}  # adapter id -> [sequences ended, tokens generated]
        # the adapters in the LoRA slots and what copying one in costs (ms), set by the GPU loop
        # (`lora_admin.LoraAdmin.after_step`): a request of another adapter is priced with a fill
        self.lora_resident: frozenset[int] = frozenset()
        self.lora_swap_ms = 0.0
        self.prefill_budget = config.prefill_budget
        self.context_limit = config.context_limit
        self.fair_preempt_steps = config.fair_preempt_steps
        self.margin_blocks = self.kv.margin(config.admission_margin)
        self.eos_token_ids = frozenset(eos_token_ids)
        self.admission = admission or AdmissionController.from_config(config, calibration)
        self.costs = self.admission.costs
        self.step_target_ms = config.step_target
        self._fixed_weight = config.output_token_weight  # 0: the cost model's
        self.queue = FairQueue(
            config.key_row_cap, self._fixed_weight or self.costs.output_token_weight(), max_rows=config.max_rows
        )
        self.audit = StepAudit()  # measured / estimated step times, by kind
        self.clock = clock
        self._rng = rng or random.Random()
        self._live: dict[WorkerRid, list[Request]] = {}  # every sample of a Submit until all have ended
        self._running: list[Request] = []  # ascending admit_seq: the newest is last
        self._step_ts = 0.0  # when the last step was built (its traced chunks start then)
        self._traced_chunks: list[tuple[Request, int]] = []  # of the last step: (request, tokens)
        self.siblings = Siblings(self.kv, config.prefix_caching)
        self.spec = (
            Speculator(config.num_speculative_tokens, config.ngram_min, config.ngram_max)
            if config.speculative == "ngram"
            else None
        )
        self._drafts: dict[Request, tuple[int, list[int]]] = {}  # the last batch's drafts: (first position, tokens)
        self.ledger = AdmissionLedger()  # waiting work per tenant, and what starts at the next pass
        self._deadlines: list[tuple[float, int, Request]] = []
        self._deadlines_kept = 0  # heap size after the last compaction (_compact_deadlines)
        self._cancels: list[Request] = []
        self._events: list[Event] = []
        self._sampling: list[Request] = []  # requests sampling in the last batch, in batch order
        self._scorer = PromptScorer()  # the last batch's chunks that score prompt tokens
        self._pooler = PromptPooler()  # and those that pool prompt positions (embeddings)
        self._ended_seqs: list[int] = []  # seq ids that ended since the last batch was built
        self._pass = 0
        self._seq_ids = itertools.count(1)
        self._next_admit_seq = 0
        self.last_shape = StepShape()  # what the last built batch holds, as the cost model prices it
        self.preemptions = 0
        self.fair_preemptions = 0
        self.cancelled_tokens = 0
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0

    # -- inputs ----------------------------------------------------------------------------------

    def admit(self, req: Request) -> Decision:
        """Price and queue `req` (and its n - 1 siblings), or refuse it (400 can never run, 429
        waiting work over its limit)."""
        if req.key in self._live:
            return Decision(400, code="duplicate_request", message=f"request {req.key} is already live")
        starts = self._starts_now(req.n, req.prompt_len)
        ahead = self.ledger.ahead_ms(req.tenant, self._prefill_owed())
        decision = self.admission.decide(
            req.prompt_len,
            req.max_tokens,
            req.n,
            0.0 if starts and ahead <= self.step_target_ms else ahead,
            pool_fits=self.kv.fits_pool(req.prompt_len, req.max_tokens, req.n),
            row_wait_ms=self._row_wait_ms,
            floor_tokens=req.sure_tokens,
            extra_ms=self.lora_swap_ms if req.lora and req.lora not in self.lora_resident else 0.0,
        )
        if decision.accepted:
            self.tenants.admitted(req.tenant, req.prompt_len)
            seed = req.sampling.seed if req.sampling.seed is not None else self._rng.getrandbits(63)
            self._queue_samples(self.siblings.fan_out(req, seed, self._seq_ids), decision.est_gpu_ms, starts)
        return decision

    def cancel(self, key: WorkerRid, reason: CancelReason = CancelReason.CANCELLED, index: int | None = None) -> bool:
        """Flag every sample of a Submit (or only sample `index`) to leave at the next step
        boundary; False if none is live and not already ending."""
        samples = self._live.get(key, [])
        if index is not None:
            samples = samples[index : index + 1] if index >= 0 else []
        flagged = False
        for req in samples:
            if not req.is_finished and req.cancel_reason is None:
                req.cancel_reason = CancelReason(reason)
                self._cancels.append(req)
                flagged = True
        return flagged

    def observe_step_time(self, ms: float, shape: StepShape | None = None) -> float:
        """Feed one measured step (default: the last built batch) to the cost model; returns what
        the model expected that step to take."""
        shape = self.last_shape if shape is None else shape
        expected = self.admission.observe_step(ms, shape)
        if not shape.empty:
            self.audit.add(shape.kind, ms, expected)
        if not self._fixed_weight:
            self.queue.output_token_weight = self.costs.output_token_weight()
        return expected

    # -- admission -------------------------------------------------------------------------------

    def _starts_now(self, n: int, prompt_len: int) -> bool:
        """Whether `n` samples of `prompt_len` tokens would join at the next pass: nothing waits
        ahead of them, and rows and blocks (without cache hits, plus the margin) are free after
        what the requests already admitted to start now will take."""
        ledger = self.ledger
        if ledger.any_waiting:
            return False
        rows = len(self._running) + ledger.reserved_rows + n
        margin = self.margin_blocks if rows > n else 0
        return rows <= self.max_rows and self.kv.fits(n, prompt_len, margin, ledger.reserved_blocks)

    def _prefill_owed(self) -> dict[str, float] | None:
        """tenant -> estimated ms of prefill its joined (or starting) requests still owe, when
        that is more than one step holds (None otherwise): their chunks run before a request that
        joins after them, so admission counts them as work ahead, as it does a queue."""
        owed: dict[str, float] = {}
        chunk_ms = self.costs.chunk_ms
        for r in self._running:
            left = r.num_tokens - r.num_computed
            if left > 1 or r.state == RequestState.PREFILL:
                owed[r.tenant] = owed.get(r.tenant, 0.0) + chunk_ms(r.num_computed, left)
        for r in self.ledger.starting:
            owed[r.tenant] = owed.get(r.tenant, 0.0) + chunk_ms(0, r.prompt_len)
        return owed if sum(owed.values()) > self.step_target_ms else None

    def tenants_near_limit(self, most: int) -> dict[str, tuple[int, int]]:
        """tenant -> (ms of work ahead of its next request, the Retry-After s of a refusal) for
        the `most` tenants with the most work ahead, of those with over half the queue limit
        ahead: workers refuse at once a request of theirs that would take it past the limit
        (`api/refusals.py`)."""
        owed = self._prefill_owed()
        if not (owed or self.ledger.any_waiting):
            return {}
        work = self.ledger.work_by_tenant(owed)
        floor = max(self.admission.queue_limit_ms / 2, self.step_target_ms)
        ahead = {t: sum(min(w, mine) for w in work.values()) for t, mine in work.items()}
        near = sorted((a, t) for t, a in ahead.items() if a > floor)[::-1][:most]
        if not near:
            return {}
        wait = self._row_wait_ms()
        return {t: (int(a), retry_after_s(a + wait)) for a, t in near}

    def _row_wait_ms(self) -> float:
        """Projected ms until a row frees (for Retry-After): 0 with one free, else until the
        running (or starting) request expected to end first ends, at the fitted step time."""
        holders = self._running + self.ledger.starting
        if len(holders) < self.max_rows:
            return 0.0
        expected = self.admission.answers.mean
        left = min(max(min(r.max_tokens, max(expected, r.sure_tokens)) - len(r.generated), 1.0) for r in holders)
        return left * self.costs.decode_step_ms(len(holders))

    def _queue_samples(self, samples: list[Request], est_ms: float, starts: bool) -> None:
        """Queue a Submit's samples, as `siblings.hold` says: all now, or sample 0 first."""
        self._live[samples[0].key] = samples
        blocks = self.kv.blocks_for(samples[0].prompt_len)
        for s in samples:
            s.est_gpu_ms = est_ms / len(samples)
            s.queued_pass, s.queued_ts = self._pass, self.clock()
            if starts:
                self.ledger.reserve(s, blocks)
            else:
                self.ledger.charge(s, s.est_gpu_ms)
            heappush(self._deadlines, (s.deadline_ts, s.seq_id, s))
        if len(self._deadlines) > 2 * self._deadlines_kept + 64:
            self._compact_deadlines()
        for s in self.siblings.hold(samples):
            self.queue.push(s)

    def _compact_deadlines(self) -> None:
        # NOTE: a finished request leaves the deadline heap only when its deadline comes (minutes);
        # without compaction the heap kept every request of the last request_timeout_s, prompts and
        # all, alive (the GPU process's RSS grew with the request rate). Compacting when the heap
        # has doubled since the last compaction keeps it amortized O(1) per request.
        self._deadlines = [entry for entry in self._deadlines if not entry[2].is_finished]
        heapify(self._deadlines)
        self._deadlines_kept = len(self._deadlines)

    def _settle_starting(self) -> None:
        """After the join: requests admitted to start now that did not (held siblings aside) are
        waiting work after all; reservations end."""
        ledger = self.ledger
        for req in ledger.starting:
            if not self.siblings.is_held(req):
                ledger.release(req)
                ledger.charge(req, req.est_gpu_ms)

    # -- the pass --------------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> StepBatch:
        """Leave, join and build one step. The batch's block tables are the live lists: valid until
        the next call, and the runner must not change them."""
        now = self.clock() if now is None else now
        self._step_ts = now
        self._pass += 1
        self._leave(now)
        self._join(now)
        batch = self._build()
        self.kv.commit()
        if self.siblings:
            self._queue_first(self.siblings.ready(self._live))
        return batch

    def update(self, samples=None) -> list[Event]:
        """Take the last batch's samples (`.token_ids`, `.logprobs`, `.top_logprobs`, one per
        sampling row in `batch.sampling_rows` order: a draft row's verified positions each;
        `.prompt_logprobs`, one (logprobs, ranks, top) per row with `scoring` in batch order, or
        None; `.pooled`, one float32 sum per row with `pooling`; None for a batch with none of
        these) and return every event since the last call, including the finishes the pass's leave
        phase made for cancelled and expired requests. Call it after every `schedule()`, even an
        empty one."""
        rows, self._sampling = self._sampling, []
        if self._traced_chunks:
            now, built = self.clock(), self._step_ts
            for req, tokens in self._traced_chunks:
                req.mark("chunk", built, now, tokens)
            self._traced_chunks = []
        if self._scorer:
            self._events += self._scorer.results(getattr(samples, "prompt_logprobs", None))
        if self._pooler:
            self._events += self._pooler.results(getattr(samples, "pooled", None))
        if samples is None:
            if rows:
                raise ValueError(f"the last batch has {len(rows)} sampling rows but no samples were given")
        else:
            token_ids, logprobs, tops = samples.token_ids, samples.logprobs, samples.top_logprobs
            want = len(rows) + sum(len(d) for _, d in self._drafts.values())
            if len(token_ids) != want:
                raise ValueError(f"{len(token_ids)} samples for {want} sampling rows")
            self._apply_samples(rows, token_ids, logprobs, tops, getattr(samples, "paused", frozenset()))
        events, self._events = self._events, []
        return events

    # -- leave -----------------------------------------------------------------------------------

    def _leave(self, now: float) -> None:
        if self._cancels:
            cancels, self._cancels = self._cancels, []
            for req in cancels:
                if not req.is_finished and req.cancel_reason is not None:
                    self._end(req, req.cancel_reason.finish, now)
        heap = self._deadlines
        while heap and heap[0][0] <= now:
            req = heappop(heap)[2]
            if not req.is_finished:
                self._end(req, FinishReason.DEADLINE, now)

    def _end(self, req: Request, reason: FinishReason, now: float) -> None:
        """Remove a queued, held or running request for good."""
        if req.is_waiting:
            if not self.siblings.discard(req):
                self.queue.remove(req)
            self.ledger.uncharge(req)
        else:
            self.kv.free(req)
            self._running.remove(req)
            self.queue.rows_ended(req.tenant, 1)
        if reason.wasted:
            self.cancelled_tokens += len(req.generated)
        self._finish(req, reason, now)

    # -- join ------------------------------------------------------------------------------------

    def _join(self, now: float) -> None:
        """Start the fair choice while it fits, preempting for it when fairness says so. A choice
        whose LoRA adapter has no slot (`max_loras` others run) waits for the adapter being drained
        and the requests behind it join past it (see `_lora_skip`)."""
        queue = self.queue
        while (req := queue.peek()) is not None:
            if req.lora and self._adapter_waits(req.lora):
                if self._draining is None or self._draining not in self._running_loras():
                    self._draining = self._drain_choice()
                req = queue.peek(self._lora_skip)
                if req is None:
                    break
            else:
                self._draining = None
            if not self._start(req, now) and not self._fair_preempt(req, now):
                break
        if self.ledger.reserved_rows:
            self._settle_starting()

    def _running_loras(self) -> set[int]:
        return {r.lora for r in self._running if r.lora}

    def _adapter_waits(self, lora: int) -> bool:
        """Adapter `lora` is not among the running rows' and `max_loras` others are."""
        running = self._running_loras()
        return lora not in running and len(running) >= self.max_loras

    def _drain_choice(self) -> int:
        """The running adapter that takes no new rows until its rows have left, freeing a slot for
        the fair choice that waits: the one with the fewest rows (it frees soonest). Without a
        drained adapter, requests of the running adapters would join past the waiting one forever."""
        counts: dict[int, int] = {}
        for r in self._running:
            if r.lora:
                counts[r.lora] = counts.get(r.lora, 0) + 1
        return min(counts, key=lambda lid: (counts[lid], lid))

    def _lora_skip(self, req: Request) -> bool:
        """While an adapter waits for a slot: what may not join past it (the drained adapter's
        requests, and other adapters without a slot). The base model's and the other running
        adapters' requests may."""
        return bool(req.lora) and (req.lora == self._draining or self._adapter_waits(req.lora))

    def _start(self, req: Request, now: float) -> bool:
        """Move `req` (the queue's fair choice) into the running set if a row and its blocks are free
        (rows kept for the held siblings of running requests are not)."""
        if len(self._running) + (self.siblings.rows_reserved(self._live) if self.siblings else 0) >= self.max_rows:
            return False
        # NOTE: an idle server admits a request that fits without the margin; otherwise a pool
        # smaller than one request plus the margin could never serve it.
        reserve = self.margin_blocks if self._running else 0
        if not self.kv.join(req, reserve):
            return False
        self.queue.rows_started(req.tenant, 1)  # first, so the tenant stays active across pop()
        self.queue.pop(req)
        self.ledger.uncharge(req)
        self.ledger.release(req)
        if req.admit_seq < 0:
            req.admit_seq = self._next_admit_seq
            self._next_admit_seq += 1
            req.first_join_ts = now
            if req.index == 0:
                self.prompt_tokens_total += req.prompt_len
            self._running.append(req)
            req.mark("join", now, now, req.num_tokens - req.num_computed)
        else:
            self._insert_running(req)
            req.mark("resume", now, now, req.num_tokens - req.num_computed)
        req.state = RequestState.PREFILL
        return True

    def _fair_preempt(self, req: Request, now: float) -> bool:
        """Preempt the newest request of the tenant most over its fair share so `req` can start,
        once `req` has waited more than `fair_preempt_steps` passes, or as long as that many
        steps at the target take (a slow or contended machine runs its passes long); True if
        one was preempted."""
        passes = self._pass - req.queued_pass
        waited_ms = (now - req.queued_ts) * 1000.0
        if passes <= self.fair_preempt_steps and waited_ms <= self.fair_preempt_steps * self.step_target_ms:
            return False
        victim_tenant = self.queue.preemptable_for(req.tenant)
        if victim_tenant is None:
            return False
        victim = next(r for r in reversed(self._running) if r.tenant == victim_tenant)
        self._preempt(victim)
        self.fair_preemptions += 1
        return True

    def _insert_running(self, req: Request) -> None:
        running = self._running
        i = len(running)
        while i > 0 and running[i - 1].admit_seq > req.admit_seq:
            i -= 1
        running.insert(i, req)

    def _queue_first(self, samples: list[Request]) -> None:
        """Queue released siblings at the front of their tenant's queue, in index order: they are
        as old as their sample 0, which already started."""
        for s in reversed(samples):
            self.queue.push_front(s)

    # -- build -----------------------------------------------------------------------------------

    def _build(self) -> StepBatch:
        decoding, prefilling = self._grow_decode_rows()
        if len(prefilling) > 1 and len(self.queue.tenants()) > 1:
            rows = {u.tenant: u.running_rows for u in self.queue.tenants()}
            prefilling.sort(key=lambda r: rows[r.tenant])  # NOTE: stable: oldest first within a rank
        seqs: list[SeqStep] = []
        self._sampling = sampling = list(decoding)
        step = self._step_yield(len(decoding)) if self.spec is not None else None
        decode, reads = 0, 0
        for req in decoding:
            p = req.num_computed
            gen = req.generated
            req.num_computed = p + 1
            draft = self._draft(req, step) if step is not None else []
            decode += 1 + len(draft)
            reads += chunk_reads(p, 1 + len(draft))
            seqs.append(
                SeqStep(
                    req.seq_id,
                    [gen[-1] if gen else req.prompt_ids[-1], *draft],
                    p,
                    req.block_ids,
                    req.row_sampling,
                    draft=len(draft),
                    # a one-token prompt, or one whose cached prefix leaves one, joins as a decode row
                    pooling=self._pooler.cut(req, p, p + 1) if req.pooling is not None else None,
                    lora=req.lora,
                )
            )
        shape = StepShape(decode=decode, reads=reads)
        filling = self._fills({r.lora for r in decoding}, set())
        budget = StepBudget.for_step(
            self.prefill_budget,
            self.max_rows,
            len(seqs),
            self.step_target_ms - self.costs.step_ms(shape) - self.lora_swap_ms * len(filling),
            self.costs,
        )
        budget.filling = filling
        self.last_shape = shape + self._prefill_chunks(prefilling, budget, seqs, sampling)
        ended, self._ended_seqs = self._ended_seqs, []
        # NOTE: `sampling` was appended in lockstep with `seqs`, so it is in batch.sampling_seqs
        # order, which is the order of the runner's logits and the sampler's output.
        return StepBatch(
            seqs=seqs,
            scores_prompts=bool(self._scorer),
            finished=ended,
            has_drafts=bool(self._drafts),
            pools=bool(self._pooler),
            loras=any(s.lora for s in seqs),
        )

    def _step_yield(self, rows: int) -> StepYield:
        """What a step of `rows` decoding rows is expected to yield, and what a draft token costs
        in it, from the cost model's fitted step times."""
        costs = self.costs
        step = costs.decode_step_ms(rows)
        return StepYield.for_step(rows, step, costs.decode_step_ms(rows + 1) - step)

    def _draft(self, req: Request, step: StepYield) -> list[int]:
        """A draft for a decoding row whose next token has its slot (`num_computed` past it), with
        slots for its tokens; [] when none is worth it, the step's time target has no room for
        it, or no block is free beyond the margin."""
        # NOTE: a step emits at most draft + 1 tokens: the draft stops short of max_tokens and the context.
        room = min(req.max_tokens - len(req.generated) - 1, self.context_limit - req.num_tokens - 1)
        if step.token_ms > 0:
            room = min(room, int((self.step_target_ms - step.ms) / step.token_ms))
        draft = self.spec.propose(req, req.tokens, req.num_tokens, room, step)  # type: ignore[union-attr]
        if not draft or not self.kv.allocate_draft_slots(req, len(draft), self.margin_blocks):
            return []
        self._drafts[req] = (req.num_computed, draft)
        req.num_computed += len(draft)
        return draft

    def _grow_decode_rows(self) -> tuple[list[Request], list[Request]]:
        """The running requests that decode this step, each now holding a slot for its next token,
        and those still prefilling, both oldest first. While a decoding request finds no free
        block, the newest request of the tenant holding the most blocks is preempted (possibly
        itself): memory pressure falls on the tenant that makes it, not on whoever joined last."""
        running, kv = self._running, self.kv
        decoding: list[Request] = []
        prefilling: list[Request] = []
        i = 0
        while i < len(running):
            req = running[i]
            if req.num_tokens - req.num_computed != 1:
                prefilling.append(req)
            elif kv.allocate_slots(req, 1) is not None:
                decoding.append(req)
            else:
                victim = self._memory_victim()
                k = running.index(victim)
                self._preempt(victim)
                if k < i:  # already placed in this step: take it out again
                    (decoding if victim in decoding else prefilling).remove(victim)
                    i -= 1
                continue  # the same request again with the victim's blocks free (or, if it was
                # the victim, the next one, now at index i)
            i += 1
        return decoding, prefilling

    def _memory_victim(self) -> Request:
        """The newest running request of the tenant whose rows hold the most blocks."""
        held: dict[str, int] = {}
        for r in self._running:
            held[r.tenant] = held.get(r.tenant, 0) + len(r.block_ids)
        tenant = max(held, key=held.__getitem__)
        return next(r for r in reversed(self._running) if r.tenant == tenant)

    def _prefill_chunks(
        self, prefilling: list[Request], budget: StepBudget, seqs: list[SeqStep], sampling: list[Request]
    ) -> StepShape:
        """Prompt (or recompute) chunks, in `prefilling`'s order, within `budget`; what they add."""
        charge, kv = self.queue.charge, self.kv
        added = StepShape()
        for req in prefilling:
            start, total = req.num_computed, req.num_tokens
            if fills := self._fills({req.lora}, budget.filling):
                budget.ms_left -= self.lora_swap_ms  # its adapter is copied into a slot before the step
                budget.filling |= fills
            end = start + budget.chunk_tokens(start, total - start)
            if end == start:
                break
            scoring = None
            if req.scores_prompt:
                end, scoring = self._scorer.cut(req, start, end, budget)
                if end == start:
                    continue  # this step's scoring allowance is spent; the chunk waits a step
            if kv.allocate_slots(req, end - start) is None:  # NOTE: the join took these blocks
                raise SchedulerIntegrityError(f"{req.key}#{req.index} lost the blocks of its prompt")
            samples = end == total
            seqs.append(
                SeqStep(
                    req.seq_id,
                    req.tokens(start, end),
                    start,
                    req.block_ids,
                    req.row_sampling if samples else None,
                    scoring,
                    self._pooler.cut(req, start, end) if req.pooling is not None else None,
                    lora=req.lora,
                )
            )
            if samples:
                sampling.append(req)
            if req.timeline is not None:
                self._traced_chunks.append((req, end - start))
            req.num_computed = end
            chunk = StepShape.chunk(start, end - start, samples) + StepShape(
                logits=len(scoring.targets) if scoring is not None else 0
            )
            budget.take_prefill(end - start, chunk)
            added = added + chunk
            charge(req.tenant, end - start, 0)
        return added

    def _fills(self, adapters: set[int], counted: set[int]) -> set[int]:
        """Of `adapters`, those this step must copy into a slot first, not yet counted in it."""
        return {a for a in adapters if a and a not in self.lora_resident and a not in counted}

    def prefill_budget_for(self, decode_rows: int) -> int:
        """Prompt tokens allowed in a step with `decode_rows` decoding rows (`step_budget.py`)."""
        return prefill_tokens_for(self.prefill_budget, self.max_rows, decode_rows)

    # -- preemption ------------------------------------------------------------------------------

    def _preempt(self, req: Request) -> None:
        """Free every block of `req` and queue it first for its tenant; it is recomputed later."""
        self.kv.free(req)
        if self._running[-1] is req:
            self._running.pop()
        else:
            self._running.remove(req)
        req.num_computed = 0
        req.state = RequestState.PREEMPTED
        req.queued_pass, req.queued_ts = self._pass, self.clock()
        req.preemptions += 1
        req.mark("preempt", req.queued_ts, req.queued_ts, len(req.generated))
        self.ledger.charge(
            req, self.admission.estimate_ms(req.prompt_len, req.max_tokens, 1, len(req.generated), req.sure_tokens)
        )
        self.queue.push_front(req)
        self.queue.rows_ended(req.tenant, 1)
        self.preemptions += 1

    # -- samples ---------------------------------------------------------------------------------

    def _apply_samples(self, rows: list[Request], token_ids, logprobs, tops, paused=frozenset()) -> None:
        now = self.clock()
        drafts = self._drafts
        k = 0
        for req in rows:
            spec = drafts.pop(req, None) if drafts else None
            if paused and req.seq_id in paused:
                self._pause(req, spec)
                k += 1 if spec is None else len(spec[1]) + 1
                continue
            if spec is None:
                self._emit(req, int(token_ids[k]), logprobs[k], tops[k], now)
                k += 1
                continue
            start, draft = spec
            n = len(draft) + 1
            sampled = [int(t) for t in token_ids[k : k + n]]
            kept = accepted_prefix(draft, sampled)
            self.spec.record(req, len(draft), kept)  # type: ignore[union-attr]
            req.num_computed = start + kept  # the kept drafts' keys are in the cache; the rest are not
            for j in range(kept + 1):  # the kept drafts, then the token sampled after them
                if self._emit(req, sampled[j], logprobs[k + j], tops[k + j], now):
                    break
            else:
                self.kv.accept_draft(req, start)
            k += n

    def _pause(self, req: Request, spec: tuple[int, list[int]] | None) -> None:
        """`req`'s samples are void this step (its grammar mask was not ready, `grammar.py`): it
        emits nothing, and its last real token is computed again next step (with any draft)."""
        req.num_computed = (spec[0] if spec is not None else req.num_computed) - 1
        self.kv.uncompute(req)

    def _emit(self, req: Request, tok: int, logprob: float, top, now: float) -> bool:
        """Append one sampled token to `req` and stream it; True when that ended the request."""
        gen = req.generated
        gen.append(tok)
        if req.state == RequestState.PREFILL:
            req.state = RequestState.DECODE
            if req.first_token_ts is None:
                req.first_token_ts = now  # TTFT ends here; a recompute does not restart it
        slot, rid = req.key
        self._events.append(
            (slot, Token(rid, req.index, tok, float(logprob), top if req.logprobs is not None else None))
        )
        self.queue.charge(req.tenant, 0, 1)
        self.tenants.generated(req.tenant)
        sp = req.sampling
        reason = finish_reason(
            tok,
            len(gen),
            req.prompt_len + len(gen),
            eos_token_ids=self.eos_token_ids,
            stop_token_ids=req.stop_ids,
            ignore_eos=sp.ignore_eos,
            max_tokens=req.max_tokens,
            context_limit=self.context_limit,
        )
        self.generation_tokens_total += 1
        if reason is None:
            return False
        self._row_done(req, reason, now)
        return True

    def _row_done(self, req: Request, reason: FinishReason, now: float) -> None:
        """A request sampled its last token: its blocks go back now."""
        self.kv.free(req)
        self._running.remove(req)
        self.queue.rows_ended(req.tenant, 1)
        self.admission.observe_answer(len(req.generated))
        self._finish(req, reason, now)

    def _finish(self, req: Request, reason: FinishReason, now: float) -> None:
        """Record the end of one sample; the Submit is forgotten once all its samples have ended."""
        req.state = RequestState.CANCELLED if reason.wasted else RequestState.DONE
        joined = req.first_join_ts if req.first_join_ts is not None else now
        ttft = (req.first_token_ts - req.arrival_ts) * 1000.0 if req.first_token_ts is not None else 0.0
        slot, rid = req.key
        first = req.first_token_ts
        finish = Finish(
            rid,
            req.index,
            reason,
            req.prompt_len,
            len(req.generated),
            max(0.0, (joined - req.arrival_ts) * 1000.0),
            max(0.0, ttft),
            max(0.0, (first - joined) * 1000.0) if first is not None else 0.0,
            max(0.0, (now - first) * 1000.0) if first is not None else 0.0,
            req.preemptions,
            req.timeline,
        )
        self._events.append((slot, finish))
        self._ended_seqs.append(req.seq_id)
        if req.lora:
            done = self._lora_done.setdefault(req.lora, [0, 0])
            done[0] += 1
            done[1] += len(req.generated)
        if self.spec is not None:
            self.spec.forget(req)
        self.ledger.release(req)
        if req.index == 0 and self.siblings:
            self._queue_first(self.siblings.release(req))
        if all(s.is_finished for s in self._live[req.key]):
            del self._live[req.key]

    # -- views -----------------------------------------------------------------------------------

    @property
    def has_work(self) -> bool:
        """Anything queued or running (the loop sleeps on its doorbell when not)."""
        return bool(self._live)

    def step_requests(self, batch: StepBatch) -> list[Request]:
        """The requests `batch` feeds, one per Submit (its samples share a key): what the GPU
        process names in its step-in-flight record (`shm/in_flight.py`)."""
        seqs = {s.seq_id for s in batch.seqs}
        keys: dict[WorkerRid, Request] = {}
        for req in self._running:
            if req.seq_id in seqs:
                keys.setdefault(req.key, req)
        return list(keys.values())

    def is_live(self, key: WorkerRid) -> bool:
        """Some sample of the Submit `key` is queued or running."""
        return key in self._live

    def live_keys(self) -> list[WorkerRid]:
        """Keys of every Submit with a sample queued or running (a copy: safe to cancel while iterating)."""
        return list(self._live)

    def stats(self) -> SchedulerStats:
        kv = self.kv.stats()
        spec = self.spec
        coef, audit = self.costs.coefficients(), self.audit
        return SchedulerStats(
            queue_depth=len(self.queue) + len(self.siblings),
            queued_gpu_seconds=max(self.ledger.total_ms, 0.0) / 1000.0,
            running_rows=len(self._running),
            kv_blocks_free=kv.free,
            kv_blocks_total=kv.total,
            kv_blocks_cached=kv.cached,
            preemptions=self.preemptions,
            fair_preemptions=self.fair_preemptions,
            cancelled_tokens=self.cancelled_tokens,
            prompt_tokens_total=self.prompt_tokens_total,
            generation_tokens_total=self.generation_tokens_total,
            c_prefill_ms=self.costs.c_prefill_ms,
            c_decode_ms=self.costs.c_decode_ms,
            cost_model_resets=self.costs.resets,
            cost_base_ms=coef["base_ms"],
            cost_token_ms=coef["per_token_ms"],
            cost_logit_ms=coef["per_logit_ms"],
            cost_read_us=coef["per_read_ms"] * 1000.0,
            step_target_ms=self.step_target_ms,
            cost_ratio_decode=audit.median("decode"),
            cost_ratio_prefill=audit.median("prefill"),
            cost_ratio_mixed=audit.median("mixed"),
            cost_steps_decode=audit.steps["decode"],
            cost_steps_prefill=audit.steps["prefill"],
            cost_steps_mixed=audit.steps["mixed"],
            prefix_cache_queries=kv.queries,
            prefix_cache_hits=kv.hits,
            spec_decode_num_drafts=spec.drafts if spec else 0,
            spec_decode_num_draft_tokens=spec.draft_tokens if spec else 0,
            spec_decode_num_accepted_tokens=spec.accepted_tokens if spec else 0,
            spec_decode_accepted_per_position=tuple(spec.accepted_per_position) if spec else (),
            **self._lora_counts(),
            tenant_requests=tuple(self.tenants.requests),
            tenant_prompt_tokens=tuple(self.tenants.prompt_tokens),
            tenant_generation_tokens=tuple(self.tenants.generation_tokens),
            tenant_running=tuple(self.tenants.gauges(r.tenant for r in self._running)),
            tenant_waiting=tuple(self.tenants.gauges(r.tenant for r in self.queue.waiting())),
        )

    def _lora_counts(self) -> dict[str, tuple[int, ...]]:
        """Rows running and requests waiting per adapter, by stats index (stats' lora_running /
        lora_waiting)."""
        index = self.lora_index
        if not index:
            return {}
        n = max(index.values()) + 1
        running, waiting, finished, tokens = [0] * n, [0] * n, [0] * n, [0] * n
        for r in self._running:
            if r.lora in index:
                running[index[r.lora]] += 1
        for r in self.queue.waiting():
            if r.lora in index:
                waiting[index[r.lora]] += 1
        for lid in list(self._lora_done):
            if lid not in index:  # freed: its index may serve another adapter from 0
                del self._lora_done[lid]
                continue
            finished[index[lid]], tokens[index[lid]] = self._lora_done[lid]
        return {
            "lora_running": tuple(running),
            "lora_waiting": tuple(waiting),
            "lora_finished": tuple(finished),
            "lora_tokens": tuple(tokens),
        }

    def lora_ids(self) -> set[int]:
        """The adapters (ids) of the requests queued or running: those whose weights must stay."""
        return {r.lora for r in self._running if r.lora} | {r.lora for r in self.queue.waiting() if r.lora}

    def snapshot(self) -> SchedulerSnapshot:
        """Every book the scheduler keeps, as read-only views (for `check_integrity` and tests)."""
        return SchedulerSnapshot(
            running=tuple(self._running),
            queued=tuple(self.queue.waiting()),
            held=tuple(self.siblings),
            live={k: tuple(v) for k, v in self._live.items()},
            ledger=self.ledger,
            max_rows=self.max_rows,
            kv=self.kv,
            queue=self.queue,
            admission=self.admission,
            max_loras=self.max_loras,
        )

    def check_integrity(self) -> None:
        """Raise SchedulerIntegrityError unless every block table, row count, queue, cached block
        and account agrees with the others (tests run it after every step; cheap enough when idle)."""
        check_scheduler(self.snapshot())
