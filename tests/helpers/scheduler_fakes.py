"""A fake engine for scheduler tests (tests/gpu_proc/test_scheduler_fakes.py shows it catches what it should).

`FakeEngine` stands in for runner + sampler: it keeps a KV "cache" of token ids per block slot,
writes every new token at its slot (as `write_kv` does), then for each sampling row reads the
row's whole context back through its block table and derives the next token from (seed,
sample_index, position, context). A wrong block table, a block freed while still read, a shared
block written by one of its readers or a recompute that skips a token all change the tokens, so
tests compare against `reference_tokens`, which generates the same function with no scheduler.

Real keys and values at a position depend on every earlier token, not only on the token there, so
each slot also holds a chain value hashed from the token and the previous position's chain value
(read back through the block table, as attention would). Sampling checks the chain against the
tokens it reads: a block reused after a different prefix (a prefix-cache bug that token ids alone
would not show) fails loudly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.gpu_proc.step import StepBatch
from ringserve.rules import finish_reason
from ringserve.shm.messages import SamplingParams, Token

VOCAB = 40
EOS = 0


def fake_token(seed: int, index: int, position: int, context: tuple[int, ...]) -> int:
    """The 'model': a deterministic function of the sampling identity and the whole context."""
    return hash((seed, index, position, context)) % VOCAB


COPY_PERIOD = 8


def copying_token(seed: int, index: int, position: int, context: tuple[int, ...]) -> int:
    """A 'model' that mostly repeats its context with a period of COPY_PERIOD tokens and now and
    then (one position in four, by hash) says something else: n-gram drafts of its output are
    often right and sometimes wrong, so speculation both keeps and rolls back."""
    h = hash((seed, index, position, context))
    if len(context) >= COPY_PERIOD and h % 4:
        return context[-COPY_PERIOD]
    return h % VOCAB


@dataclass
class FakeSamples:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


class FakeEngine:
    """Runner + sampler over a token-id KV cache (see the module docstring)."""

    def __init__(self, num_blocks: int, block_size: int = 16, model=fake_token) -> None:
        self.block_size = block_size
        self.model = model
        self.cache: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.chain: list[list[int | None]] = [[None] * block_size for _ in range(num_blocks)]
        self.steps = 0

    def run(self, batch: StepBatch) -> FakeSamples:
        bs = self.block_size
        for s in batch.seqs:
            if len(s.block_table) * bs < s.context_len:
                raise AssertionError(f"seq {s.seq_id}: {len(s.block_table)} blocks for {s.context_len} tokens")
            table = s.block_table
            for j, tok in enumerate(s.token_ids):
                p = s.start_pos + j
                prev = self.chain[table[(p - 1) // bs]][(p - 1) % bs] if p else 0
                if prev is None:
                    raise AssertionError(f"seq {s.seq_id}: position {p - 1} read before it was written")
                self.cache[table[p // bs]][p % bs] = tok
                self.chain[table[p // bs]][p % bs] = hash((prev, tok))
        out = FakeSamples([], [], [])
        for s in batch.sampling_rows:  # a draft row: each verified position
            ctx = tuple(self.cache[s.block_table[p // bs]][p % bs] for p in range(s.context_len))
            chain = 0
            for p, tok in enumerate(ctx):
                chain = hash((chain, tok))
                if self.chain[s.block_table[p // bs]][p % bs] != chain:
                    raise AssertionError(f"seq {s.seq_id}: keys at position {p} were computed after other tokens")
            sp = s.sampling
            out.token_ids.append(self.model(sp.seed, sp.sample_index, s.context_len, ctx))
            out.logprobs.append(-0.5)
            out.top_logprobs.append([(0, -0.5)] if sp.logprobs else None)
        self.steps += 1
        return out


def reference_tokens(
    prompt: list[int],
    seed: int,
    index: int,
    max_tokens: int,
    *,
    context_limit: int = 8192,
    stop_token_ids: tuple[int, ...] = (),
    ignore_eos: bool = False,
    model=fake_token,
) -> tuple[list[int], str]:
    """What one row must stream with no batching, preemption or sharing, and its finish reason."""
    ctx = list(prompt)
    out: list[int] = []
    while True:
        tok = model(seed, index, len(ctx), tuple(ctx))
        ctx.append(tok)
        out.append(tok)
        reason = finish_reason(
            tok,
            len(out),
            len(ctx),
            eos_token_ids={EOS},
            stop_token_ids=stop_token_ids,
            ignore_eos=ignore_eos,
            max_tokens=max_tokens,
            context_limit=context_limit,
        )
        if reason:
            return out, reason


@dataclass
class Harness:
    """A scheduler, its block manager, a fake engine and a fake clock, plus every event seen."""

    sched: Scheduler
    engine: FakeEngine
    now: float = 1000.0
    tokens: dict = field(default_factory=dict)  # (key, index) -> [token ids]
    finishes: dict = field(default_factory=dict)  # (key, index) -> FinishEvent
    batches: list = field(default_factory=list)

    def step(self, dt: float = 0.01) -> StepBatch:
        """One pass: schedule, run the fake engine, fold samples back, record events."""
        self.now += dt
        batch = self.sched.schedule(self.now)
        samples = self.engine.run(batch) if batch.seqs else None
        for slot, ev in self.sched.update(samples):
            key = (slot, ev.rid)
            if isinstance(ev, Token):
                if (key, ev.index) in self.finishes:
                    raise AssertionError(f"token after finish for {key}#{ev.index}")
                self.tokens.setdefault((key, ev.index), []).append(ev.token_id)
            else:
                if (key, ev.index) in self.finishes:
                    raise AssertionError(f"second finish for {key}#{ev.index}")
                self.finishes[(key, ev.index)] = ev
        self.batches.append(batch)
        self.sched.check_integrity()
        return batch

    def run_until_idle(self, max_steps: int = 10_000) -> int:
        for k in range(max_steps):
            if not self.sched.has_work:
                return k
            self.step()
        raise AssertionError(f"still busy after {max_steps} steps")


def make_harness(num_blocks: int = 64, model=fake_token, calibration=(), **config) -> Harness:
    """A harness whose scheduler prices steps from `calibration` (timed steps, as the GPU process
    measures at start-up) or, with none, from the configured constants."""
    config.setdefault("queue_limit_s", 1e6)
    cfg = Config(**config)
    h = Harness(sched=None, engine=FakeEngine(num_blocks, cfg.block_size, model))  # type: ignore[arg-type]
    h.sched = Scheduler(
        cfg,
        BlockManager(num_blocks, cfg.block_size),
        eos_token_ids={EOS},
        clock=lambda: h.now,
        rng=random.Random(7),
        calibration=calibration,
    )
    return h


def make_request(
    rid: int,
    prompt: list[int] | int,
    max_tokens: int = 8,
    *,
    worker: int = 0,
    tenant: str = "a",
    n: int = 1,
    seed: int | None = 1,
    arrival: float = 0.0,
    deadline: float = 1e12,
    ignore_eos: bool = False,
    stop_token_ids: tuple[int, ...] = (),
    logprobs: int | None = None,
) -> Request:
    if isinstance(prompt, int):
        prompt = [1 + (rid * 7 + k * 3) % (VOCAB - 1) for k in range(prompt)]
    return Request(
        key=(worker, rid),
        request_id=f"req-{worker}-{rid}",
        tenant=tenant,
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=SamplingParams(seed=seed, ignore_eos=ignore_eos, stop_token_ids=stop_token_ids),
        arrival_ts=arrival,
        deadline_ts=deadline,
        n=n,
        logprobs=logprobs,
    )


def expected_stream(h: Harness, req: Request, index: int = 0) -> tuple[list[int], str]:
    seed = req.row_sampling.seed  # every sample of a Submit shares the seed; `index` picks its stream
    return reference_tokens(
        req.prompt_ids,
        seed,
        index,
        req.max_tokens,
        context_limit=h.sched.context_limit,
        stop_token_ids=req.sampling.stop_token_ids,
        ignore_eos=req.sampling.ignore_eos,
        model=h.engine.model,
    )


# -- the fake itself -------------------------------------------------------------------------------
