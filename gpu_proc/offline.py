"""Offline generation: the real scheduler and engine without the rings, for tests, benchmarks and
quick experiments.

Every request is admitted at once under one tenant (the scheduler queues what does not fit),
scheduled by `scheduler.py` exactly as the server does (chunked prefill under the step budget
while other rows decode, preemption when the pool runs out, prefix caching off), and run by the
engine's step (`Executor.step`: the runner, the logits controls, the sampler). Blocks can come
from a shuffled free list, so block ids are not in position order.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from ringserve.config import DEFAULTS, Config
from ringserve.rules import sampling_violation, submit_violation
from ringserve.shm.messages import Finish, SamplingParams, Submit, Token

from .block_manager import BlockManager
from .executor import Executor
from .model_runner import ModelRunner
from .request import Request
from .scheduler import Scheduler

if TYPE_CHECKING:
    from .model.llama import Llama

GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True, kw_only=True)
class OfflineRequest:
    """One prompt for `generate`. Its sampling settings are the server's one type, with its defaults
    (temperature 1.0: pass `GREEDY` for argmax) and checked by the server's rules."""

    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams = SamplingParams()
    logprobs: int | None = None
    lora: str | None = None  # the adapter it runs (loaded in the runner's `loras`); None: the base model

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        found = sampling_violation(self.sampling)
        if found is not None:
            raise ValueError(found.message)


@dataclass(slots=True)
class OfflineResult:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish_reason: str | None = None


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
    context_limit: int = DEFAULTS.context_limit,
    prefill_budget: int = DEFAULTS.prefill_budget,
    max_rows: int = DEFAULTS.max_rows,
    block_seed: int | None = None,
    log: list[StepRecord] | None = None,
    speculative: str = DEFAULTS.speculative,
) -> list[OfflineResult]:
    """Run `requests` to completion and return their results in order.

    `prefill_budget` caps the prompt tokens per step (a prompt longer than that is chunked);
    `block_seed` shuffles the free list; `log`, when given, receives one `StepRecord` per step;
    `speculative`: the server's `--speculative` (`ngram`: n-gram speculative decoding).
    """
    num_blocks, bs = runner.kv_pool.num_blocks, runner.block_size
    order = list(range(num_blocks))
    if block_seed is not None:
        random.Random(block_seed).shuffle(order)
    config = Config(
        max_rows=max_rows,
        prefill_budget=prefill_budget,
        context_limit=context_limit,
        block_size=bs,
        num_blocks=num_blocks,
        queue_limit_s=1e9,  # offline: every request waits its turn, none is refused for load
        prefix_caching=False,
        speculative=speculative,
        max_loras=runner.loras.max_loras if runner.loras is not None else DEFAULTS.max_loras,
    )
    vocab_size = int(getattr(runner.model, "args").vocab_size)  # noqa: B009 (a Module attribute)
    engine = Executor(runner, frozenset(eos_token_ids), vocab_size, num_blocks, runner.device, runner.kv_pool.dtype)
    sched = Scheduler(config, BlockManager(num_blocks, bs, order), eos_token_ids=eos_token_ids, clock=lambda: 0.0)
    prompt_len: dict[int, int] = {}
    for i, r in enumerate(requests):
        # NOTE: the check the GPU loop runs on every Submit; the scheduler's admission then refuses
        # what does not fit the context, as the server's does.
        submit = Submit(
            rid=i,
            request_id=f"offline-{i}",
            tenant="offline",
            prompt_ids=list(r.prompt_ids),
            max_tokens=r.max_tokens,
            sampling=r.sampling,
            arrival_ts=0.0,
            deadline_ts=1e18,
            logprobs=r.logprobs,
            lora=r.lora,
        )
        found = submit_violation(submit, vocab_size, eos_token_ids)
        if found is not None:
            raise ValueError(f"offline request {i}: {found.message}")
        lora = 0
        if r.lora is not None:
            if runner.loras is None or r.lora not in runner.loras.ids:
                raise ValueError(f"offline request {i}: no LoRA adapter {r.lora!r} is loaded")
            lora = runner.loras.ids[r.lora]
        req = Request.from_submit(0, submit, lora=lora)
        decision = sched.admit(req)
        if not decision.accepted:
            raise RuntimeError(f"offline request {i} refused: {decision.message}")
        prompt_len[req.seq_id] = req.prompt_len
    results = [OfflineResult() for _ in requests]
    while sched.has_work:
        batch = sched.schedule(0.0)
        samples = engine.step(batch) if batch.seqs else None
        if samples is None:
            engine.release(batch.finished)
        if log is not None and batch.seqs:
            prefill = sum(1 for s in batch.seqs if s.start_pos < prompt_len[s.seq_id])
            log.append(StepRecord(len(batch.seqs), batch.num_tokens, prefill, len(batch.seqs) - prefill))
        for _, ev in sched.update(samples):
            res = results[ev.rid]
            if isinstance(ev, Token):
                res.token_ids.append(ev.token_id)
                res.logprobs.append(ev.logprob)
                res.top_logprobs.append(ev.top_logprobs)
            elif isinstance(ev, Finish):
                res.finish_reason = str(ev.reason)
    return results


def prefill_logits(runner: ModelRunner, ids: list[int]):
    """The logits `[len(ids), vocab]` of one prefill of `ids` into a fresh sequence (blocks
    0, 1, ... of the runner's pool), every position scored."""
    import torch

    from .step import RowSampling, SeqStep, StepBatch

    batch = StepBatch([SeqStep(0, ids, 0, list(range((len(ids) + 15) // 16)), RowSampling(temperature=0.0))])
    inputs = runner.prepare(batch)
    m = cast("Llama", runner.model)
    hidden = m.final_hidden(inputs.input_ids, inputs.meta, runner.kv_pool, torch.arange(len(ids)))
    return m.head(hidden)


def loglikelihood(runner: ModelRunner, ids: list[int]) -> float:
    """Sum of log p(ids[i+1] | ids[:i+1]) over the sequence, in float64 (one prefill)."""
    import torch

    logp = torch.log_softmax(prefill_logits(runner, ids).double(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()
