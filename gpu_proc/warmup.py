"""Warm-up inside the engine's load: nothing compiles, and nothing is first used, in a served step.

Before the GPU process declares READY it (1) compiles every attention kernel the model launches
(through the backend's `compile`, one kernel at a time, or loads them from CuPy's disk cache) and
(2) runs two steps through every path a served step takes: a mixed step (a prefill chunk that
crosses a block boundary beside a decode row: KV append, the decode and prefill kernels, the GEMMs,
the sampler) and a decode-only step. `progress()` is called between kernels and between phases, so
the supervisor sees heartbeats during a long compile (its watchdog would otherwise kill a process
that compiles for longer than the watchdog timeout, and every restart would compile again).

The steps write keys and values into the first blocks of the pool; those are zeroed afterwards, so
the pool is as the scheduler expects it: untouched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch

from .model_runner import ModelRunner
from .sampler import sample
from .step import RowSampling, SeqStep, StepBatch

if TYPE_CHECKING:
    from .model.llama import Llama

log = logging.getLogger("ringserve.gpu")

PREFILL_TOKENS = 17  # crosses a block boundary (block 16)
DECODE_POSITION = 5


@dataclass(frozen=True)
class WarmupReport:
    compiled: tuple[str, ...]  # kernels compiled (or loaded from the compile cache)
    compile_s: float
    steps_s: float


def warmup_steps(vocab_size: int, block_size: int) -> tuple[StepBatch, StepBatch]:
    """A mixed step (a chunk over the first blocks, a decode row in the next) and a decode-only
    step continuing both; they use the first `warmup_blocks(block_size)` blocks."""
    greedy = RowSampling(temperature=0.0)
    tok = min(1, vocab_size - 1)
    n = warmup_blocks(block_size) - 1
    chunk_table, row_table = list(range(n)), [n]
    mixed = StepBatch(
        [
            SeqStep(0, [tok] * PREFILL_TOKENS, 0, chunk_table, greedy),
            SeqStep(1, [tok], DECODE_POSITION, row_table, greedy),
        ]
    )
    decode = StepBatch(
        [
            SeqStep(0, [tok], PREFILL_TOKENS, chunk_table, greedy),
            SeqStep(1, [tok], DECODE_POSITION + 1, row_table, greedy),
        ]
    )
    return mixed, decode


def warmup_blocks(block_size: int) -> int:
    """Blocks the warm-up steps write: the chunk's (and its decode token's), plus the decode row's."""
    return -(-(PREFILL_TOKENS + 1) // block_size) + 1


def warm_up(runner: ModelRunner, progress: Callable[[], None] | None = None) -> WarmupReport:
    """Compile the model's kernels and run the warm-up steps; `progress()` between each piece."""
    beat = progress or (lambda: None)
    model, pool = cast("Llama", runner.model), runner.kv_pool
    used = warmup_blocks(pool.block_size)
    if pool.num_blocks < used or DECODE_POSITION + 2 > pool.block_size:
        raise ValueError(
            f"warm-up needs a pool of at least {used} blocks of >= {DECODE_POSITION + 2} tokens, "
            f"got {pool.num_blocks} x {pool.block_size}"
        )
    t0 = time.perf_counter()
    compiled: tuple[str, ...] = ()
    backend = model.backend
    if backend is not None and backend.compile is not None:
        args = model.args
        compiled = tuple(
            backend.compile(model.dtype, args.head_dim, args.num_heads, args.num_kv_heads, runner.device, beat)
        )
    t1 = time.perf_counter()
    beat()
    for batch in warmup_steps(model.args.vocab_size, pool.block_size):
        logits = runner.execute(batch)
        rows = [(s.sampling, s.context_len) for s in batch.sampling_seqs if s.sampling is not None]
        sample(logits, [sp for sp, _ in rows], [pos for _, pos in rows])
        beat()
    with torch.no_grad():
        pool.k_all[:, :used].zero_()
        pool.v_all[:, :used].zero_()
    if runner.device.type == "cuda":
        torch.cuda.synchronize(runner.device)
    t2 = time.perf_counter()
    beat()
    if compiled:
        log.info("compiled %d attention kernels in %.1f s; warm-up steps %.2f s", len(compiled), t1 - t0, t2 - t1)
    return WarmupReport(compiled, t1 - t0, t2 - t1)
