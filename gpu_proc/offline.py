"""Offline generation: drive the runner and sampler without the scheduler or any IPC.

For tests, benchmarks and quick experiments: every request is admitted at once (up to `max_rows`
running), prompts are prefilled in chunks under a per-step token budget while other rows decode,
blocks come from a simple free list (optionally shuffled, so block ids are not in position order),
and the engine's stop rules end each row. The real server's scheduler (fairness, preemption,
admission) lives in `scheduler.py`; this is the smallest loop that produces a step mix.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from ringserve.rules import finish_reason

from .model_runner import ModelRunner
from .sampler import sample
from .step import RowSampling, SeqStep, StepBatch


@dataclass(frozen=True, kw_only=True)
class OfflineRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    logprobs: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")


@dataclass(slots=True)
class OfflineResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass(slots=True)
class _Row:
    index: int
    req: OfflineRequest
    blocks: list[int]
    result: OfflineResult
    computed: int = 0  # tokens already in the KV cache

    @property
    def all_ids(self) -> list[int]:
        return self.req.prompt_ids + self.result.token_ids


@dataclass(slots=True)
class StepRecord:
    """What one step held: for checking that a run really mixed decode rows and prefill chunks."""

    num_rows: int
    num_tokens: int
    num_prefill_rows: int
    num_decode_rows: int


def generate(
    runner: ModelRunner,
    requests: list[OfflineRequest],
    *,
    eos_token_ids: frozenset[int],
    context_limit: int = 8192,
    prefill_budget: int = 256,
    max_rows: int = 32,
    block_seed: int | None = None,
    log: list[StepRecord] | None = None,
) -> list[OfflineResult]:
    """Run `requests` to completion and return their results in order.

    `prefill_budget` caps the prompt tokens per step (a prompt longer than that is chunked);
    `block_seed` shuffles the free list; `log`, when given, receives one `StepRecord` per step.
    """
    bs = runner.block_size
    free = list(range(runner.kv_pool.num_blocks))
    if block_seed is not None:
        random.Random(block_seed).shuffle(free)
    pending = [_Row(i, r, [], OfflineResult()) for i, r in enumerate(requests)]
    pending.reverse()  # pop() admits in request order
    running: list[_Row] = []
    results: list[OfflineResult | None] = [None] * len(requests)
    while pending or running:
        while pending and len(running) < max_rows:
            running.append(pending.pop())
        budget = prefill_budget
        steps: list[tuple[_Row, SeqStep]] = []
        for row in running:
            ids = row.all_ids
            prompt_left = len(row.req.prompt_ids) - row.computed
            if prompt_left > 0:
                n = min(prompt_left, budget)
                if n == 0:
                    continue
                budget -= n
            else:
                n = 1  # decode: feed the last sampled token
            end = row.computed + n
            need = (end + bs - 1) // bs - len(row.blocks)
            if need > len(free):
                raise RuntimeError(f"KV pool exhausted: {runner.kv_pool.num_blocks} blocks are too few")
            row.blocks += [free.pop() for _ in range(need)]
            samples = end >= len(ids)
            sampling = (
                RowSampling(
                    temperature=row.req.temperature,
                    top_k=row.req.top_k,
                    top_p=row.req.top_p,
                    seed=row.req.seed,
                    logprobs=row.req.logprobs,
                )
                if samples
                else None
            )
            steps.append((row, SeqStep(row.index, ids[row.computed : end], row.computed, row.blocks, sampling)))
        batch = StepBatch([s for _, s in steps])
        logits = runner.execute(batch)
        samplers = [(row, s, s.sampling) for row, s in steps if s.sampling is not None]
        out = sample(logits, [sp for _, _, sp in samplers], [s.context_len for _, s, _ in samplers])
        if log is not None:
            prefill = sum(1 for row, s in steps if s.start_pos < len(row.req.prompt_ids))
            log.append(StepRecord(len(steps), batch.num_tokens, prefill, len(steps) - prefill))
        for row, s in steps:
            row.computed = s.context_len
        for j, (row, s, _) in enumerate(samplers):
            res = row.result
            res.token_ids.append(out.token_ids[j])
            res.logprobs.append(out.logprobs[j])
            res.top_logprobs.append(out.top_logprobs[j])
            res.finish_reason = finish_reason(
                out.token_ids[j],
                len(res.token_ids),
                s.context_len + 1,
                eos_token_ids=eos_token_ids,
                stop_token_ids=frozenset(row.req.stop_token_ids),
                ignore_eos=row.req.ignore_eos,
                max_tokens=row.req.max_tokens,
                context_limit=context_limit,
            )
        still = []
        for row in running:
            if row.result.finish_reason is None:
                still.append(row)
            else:
                free += row.blocks
                results[row.index] = row.result
        running = still
    done = [r for r in results if r is not None]
    if len(done) != len(results):
        raise RuntimeError(f"{len(results) - len(done)} requests never finished")
    return done
