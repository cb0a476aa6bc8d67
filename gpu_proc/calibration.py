"""Start-up calibration of the step cost model (`docs/design.md#cost-model`): before the GPU process
reports READY it times synthetic steps of each kind on its own device — decode rows at short and
long contexts, prefill chunks of several sizes and at an offset, and a mixed step — so the first
request is priced by what a step costs on this machine, not by constants written for another.

Each shape runs `ROUNDS` times, the rounds interleaved (a transient stall hits one sample of several
shapes, not every sample of one), and its median is kept; the samples become the cost model's prior
(`CostModel(calibration=...)`). The whole calibration stays within `BUDGET_S`: once spent, the
remaining shapes are skipped (the first shapes alone span every coefficient). Decode rows get
blocks of their own where the pool has room (rows sharing blocks would read each other's keys
from cache and look cheaper than they are). The steps write into the first blocks of the pool,
which are zeroed afterwards, as the warm-up does.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .cost_model import CostModel, Sample
from .step import RowSampling, SeqStep, StepBatch
from .step_shape import StepShape

log = logging.getLogger("ringserve.gpu")

ROUNDS = 3
BUDGET_S = 15.0  # wall time the calibration may take, all rounds together (CPU: ~5 s for SmolLM2)


@dataclass(frozen=True, slots=True)
class _Shape:
    rows: int  # decode rows
    context: int  # of each decode row
    chunk: int = 0  # prefill tokens (one chunk)
    chunk_start: int = 0


def _shapes(max_rows: int, prefill_budget: int, max_context: int, pool_tokens: int) -> list[_Shape]:
    """The shapes timed, in the order they are worth having (module docstring), within the
    context and the pool."""
    max_context = min(max_context, pool_tokens // 2)
    r = max_rows
    long_ctx = max(16, min(1024, max_context // 2))
    mid = min(prefill_budget // 4, max_context // 4) or 1
    offset = max(0, min(512, max_context - mid - 1))
    shapes = [
        _Shape(1, 16),
        _Shape(r, 16),
        _Shape(0, 0, mid),
        _Shape(0, 0, mid, offset),
        _Shape(r, long_ctx),
        _Shape(max(1, r // 4), 16),
        _Shape(0, 0, min(16, max_context - 1)),
        _Shape(0, 0, min(prefill_budget, max_context - 1)),
        _Shape(r, 16, mid),
    ]
    return [s for s in shapes if s.rows + s.chunk > 0 and max(s.context + 1, s.chunk_start + s.chunk) <= max_context]


def calibrate(executor, max_rows: int, prefill_budget: int, context_limit: int, progress=None) -> list[Sample]:
    """Time the calibration shapes with `executor` (an `executor.Executor`); the samples, each a
    `StepShape` and its median ms."""
    beat: Callable[[], None] = progress or (lambda: None)
    runner = executor.runner
    pool = runner.kv_pool
    limit = min(context_limit, runner.max_position or context_limit)
    bs = pool.block_size
    shapes = _shapes(max_rows, prefill_budget, limit, pool.num_blocks * bs)
    times: dict[_Shape, list[float]] = {s: [] for s in shapes}
    used = 0
    t0 = time.monotonic()
    for _ in range(ROUNDS):
        for shape in shapes:
            if time.monotonic() - t0 > BUDGET_S:
                break
            batch, blocks = _batch(shape, bs, pool.num_blocks, executor.vocab_size)
            used = max(used, blocks)
            start = time.perf_counter()
            executor.step(batch)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            times[shape].append((time.perf_counter() - start) * 1e3)
            beat()
    with torch.no_grad():
        pool.k_all[:, :used].zero_()
        pool.v_all[:, :used].zero_()
    samples = [(_step_shape(s), statistics.median(ms)) for s, ms in times.items() if ms]
    log.info(
        "cost model calibrated from %d steps of %d shapes in %.1f s",
        sum(len(ms) for ms in times.values()),
        len(samples),
        time.monotonic() - t0,
    )
    return samples


def _step_shape(s: _Shape) -> StepShape:
    shape = StepShape.decode_rows(s.rows, s.context) if s.rows else StepShape()
    return shape + StepShape.chunk(s.chunk_start, s.chunk) if s.chunk else shape


def _batch(s: _Shape, block_size: int, num_blocks: int, vocab_size: int) -> tuple[StepBatch, int]:
    """The shape as a step, and the blocks it writes (from block 0 on)."""
    # NOTE: temperature 1 with a seed: the sampler's full path, the API's default (greedy is cheaper)
    sampling = RowSampling(temperature=1.0, seed=1)
    tok = min(1, vocab_size - 1)
    need = -(-(s.context + 1) // block_size)  # blocks of one decode row
    own = s.rows * need <= num_blocks // 2  # every row its own blocks, if half the pool holds them
    seqs: list[SeqStep] = []
    for i in range(s.rows):
        first = i * need if own else 0
        seqs.append(SeqStep(i, [tok], s.context, list(range(first, first + need)), sampling))
    used = s.rows * need if own else need
    if s.chunk:
        cneed = -(-(s.chunk_start + s.chunk) // block_size)
        first = used if used + cneed <= num_blocks else 0
        table = list(range(first, first + cneed))
        seqs.append(SeqStep(s.rows, [tok] * s.chunk, s.chunk_start, table, sampling))
        used = max(used, first + cneed)
    return StepBatch(seqs), min(used, num_blocks)


def describe(costs: CostModel, max_rows: int, prefill_budget: int, target_ms: float) -> str:
    """One line for the log: the coefficients and what they make of a full batch and a chunk."""
    c = costs.coefficients()
    return (
        f"base {c['base_ms']:.2f} ms, {c['per_token_ms']:.3f} ms/token, {c['per_logit_ms']:.3f} ms/logits row, "
        f"{c['per_read_ms'] * 1e3:.3f} us/key read; a {max_rows}-row decode step "
        f"{costs.decode_step_ms(max_rows):.1f} ms, a {prefill_budget}-token chunk "
        f"{costs.step_ms(StepShape.chunk(0, prefill_budget)):.1f} ms; steps held to {target_ms:.0f} ms"
    )
