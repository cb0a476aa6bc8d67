"""The four ways to form a batch that `ringserve bench sched` compares, behind one small interface.

    policy.add(rid, prompt_ids, output_tokens, key, now)   # a request arrives
    batch = policy.schedule(now)                           # a StepBatch for the runner (may be empty)
    done = policy.update(samples, now)                     # -> [(rid, emitted_token, finished)]
    policy.wake_time()                                     # when an idle policy wants to run again

- `ContinuousPolicy` is the product: the real `gpu_proc.scheduler.Scheduler` (leave / join / build
  every step, paged blocks, preemption). Chunked prefill is its prefill budget; "continuous without
  chunking" is the same scheduler with a budget as large as the context, so a joining prompt is
  prefilled in one step.
- `RunToCompletionPolicy` is static batching (`window_s=None`: fire when `max_rows` requests wait,
  or when no more will come) and dynamic batching (fire when full or when the oldest has waited
  `window_s`). A fired batch prefills every prompt in one step, then decodes until its longest
  answer ends. NOTE: rows whose answer is done keep computing until then, as in a static-batch
  engine (HF `generate`): that idle work is the cost docs/design.md#scheduler-pass avoids.

Every policy answers greedily with EOS ignored, so output lengths replay the trace exactly.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from ringserve.shm.messages import Finish, SamplingParams

NEVER_S = 1e9  # deadline / queue limit that never binds in a benchmark


class ContinuousPolicy:
    """Continuous batching through the product's scheduler; `prefill_budget=None` means no chunking."""

    def __init__(
        self,
        *,
        max_rows: int,
        prefill_budget: int | None,
        num_blocks: int,
        block_size: int = 16,
        context_limit: int = 8192,
        admission_margin: float = 0.05,
    ) -> None:
        from ringserve.config import Config

        self.name = "continuous" if prefill_budget is None else "chunked"
        budget = context_limit if prefill_budget is None else prefill_budget
        config = Config(
            max_rows=max_rows,
            prefill_budget=budget,
            context_limit=context_limit,
            max_tokens_limit=context_limit - 1,
            queue_limit_s=NEVER_S,
            block_size=block_size,
            admission_margin=admission_margin,
            key_row_cap=max_rows,
            # NOTE: the policies compared are the seed's token budgets; the step's time target
            # (the cost model's, priced for no simulated executor) is left out of them
            step_target_ms=NEVER_S * 1000,
        )
        self._now = 0.0
        self.sched = Scheduler(config, BlockManager(num_blocks, block_size), clock=lambda: self._now)

    @property
    def last_prefill_tokens(self) -> int:
        return self.sched.last_shape.prefill

    @property
    def last_decode_rows(self) -> int:
        return self.sched.last_shape.decode

    @property
    def preemptions(self) -> int:
        return self.sched.preemptions

    def add(self, rid: int, prompt_ids: list[int], output_tokens: int, key: str, now: float) -> None:
        req = Request(
            key=(0, rid),
            request_id=f"r{rid}",
            tenant=key,
            prompt_ids=prompt_ids,
            max_tokens=output_tokens,
            sampling=SamplingParams(temperature=0.0, seed=0, ignore_eos=True),
            arrival_ts=now,
            deadline_ts=now + NEVER_S,
        )
        decision = self.sched.admit(req)
        if not decision.accepted:
            raise RuntimeError(f"request {rid} refused ({decision.status}): {decision.message}")

    def schedule(self, now: float) -> StepBatch:
        self._now = now
        return self.sched.schedule(now)

    def update(self, samples, now: float) -> list[tuple[int, bool, bool]]:
        self._now = now
        out = []
        for _, ev in self.sched.update(samples):
            out.append((ev.rid, not isinstance(ev, Finish), isinstance(ev, Finish)))
        return out

    def flush(self) -> None:
        """No more arrivals: nothing changes for a policy that never waits for a batch to fill."""

    def wake_time(self) -> float | None:
        return None

    def check_integrity(self) -> None:
        self.sched.check_integrity()


@dataclass(slots=True)
class _Row:
    rid: int
    prompt_ids: list[int]
    want: int  # output tokens this request asked for
    arrival: float
    generated: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    computed: int = 0
    seq_id: int = 0


class RunToCompletionPolicy:
    """Static (`window_s=None`) or dynamic batching: a batch forms, then runs until its longest ends."""

    def __init__(self, *, max_rows: int, window_s: float | None, num_blocks: int, block_size: int = 16) -> None:
        if window_s is not None and window_s < 0:
            raise ValueError(f"window_s must be >= 0, got {window_s}")
        self.name = "static" if window_s is None else "dynamic"
        self.max_rows = max_rows
        self.window_s = window_s
        self.bm = BlockManager(num_blocks, block_size)
        self.queue: deque[_Row] = deque()
        self.batch: list[_Row] = []
        self.flushing = False
        self.last_prefill_tokens = 0
        self.last_decode_rows = 0
        self.preemptions = 0  # blocks are reserved up front: never preempts
        self._sampling: list[_Row] = []

    def add(self, rid: int, prompt_ids: list[int], output_tokens: int, key: str, now: float) -> None:
        self.queue.append(_Row(rid, prompt_ids, output_tokens, now))

    def flush(self) -> None:
        """No more arrivals will come: a partial batch may fire."""
        self.flushing = True

    def wake_time(self) -> float | None:
        if self.batch or not self.queue or self.window_s is None:
            return None
        return self.queue[0].arrival + self.window_s

    def _fire(self, now: float) -> None:
        q = self.queue
        ready = (
            len(q) >= self.max_rows
            or self.flushing
            or (self.window_s is not None and q and now >= q[0].arrival + self.window_s)
        )
        if not q or not ready:
            return
        rows = list(q)[: self.max_rows]
        # Every row holds its prompt plus the batch's longest answer: finished rows keep decoding.
        while rows:
            longest = max(r.want for r in rows)
            need = sum(self.bm.blocks_for(len(r.prompt_ids) + longest) for r in rows)
            if need <= self.bm.num_free:
                break
            rows.pop()
        if not rows:
            raise RuntimeError(f"the KV pool ({self.bm.num_blocks} blocks) cannot hold request {q[0].rid}")
        for i, r in enumerate(rows):
            q.popleft()
            r.blocks = self.bm.allocate(self.bm.blocks_for(len(r.prompt_ids) + longest))
            r.seq_id = i
        self.batch = rows

    def schedule(self, now: float) -> StepBatch:
        if not self.batch:
            self._fire(now)
        seqs, self._sampling = [], []
        prefill = decode = 0
        greedy = RowSampling(temperature=0.0)
        for r in self.batch:
            ids = r.prompt_ids + r.generated
            new = ids[r.computed :]
            if r.computed < len(r.prompt_ids):
                prefill += len(new)
            else:
                decode += 1
            seqs.append(SeqStep(r.seq_id, new, r.computed, r.blocks, greedy))
            self._sampling.append(r)
            r.computed = len(ids)
        self.last_prefill_tokens, self.last_decode_rows = prefill, decode
        return StepBatch(seqs=seqs)

    def update(self, samples, now: float) -> list[tuple[int, bool, bool]]:
        rows, self._sampling = self._sampling, []
        if not rows:
            return []
        out = []
        for r, tok in zip(rows, samples.token_ids):
            was_done = len(r.generated) >= r.want
            r.generated.append(tok)
            if not was_done:
                done = len(r.generated) >= r.want
                out.append((r.rid, True, done))
        if all(len(r.generated) >= r.want for r in self.batch):  # the longest answer is done
            for r in self.batch:
                self.bm.free(r.blocks)
                r.blocks = []
            self.batch = []
        return out

    def check_integrity(self) -> None:
        self.bm.check_integrity()
        if not self.batch and self.bm.num_free != self.bm.num_blocks:
            raise RuntimeError(f"{self.bm.num_blocks - self.bm.num_free} blocks held with no batch running")
