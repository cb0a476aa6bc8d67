"""CUDA graphs for decode-only steps: the model forward (embedding through logits) replayed, not
launched kernel by kernel.

An eager Llama decode step launches several hundred kernels (32 layers x norms, projections,
rotary, KV append, attention, MLP); at small batch on a 7B model their launch overhead is of the
order of the whole bandwidth-bound step. So the engine captures the forward once per padded row
count of a ladder (1, 2, 4, 8, 16, 24, 32, ... up to the row cap) during its load, over static
device buffers that hold the step's metadata, and a decode-only step that fits replays the
smallest graph with room for its rows:

- the step's token ids, positions, KV slots, context lengths and block tables are copied into the
  static buffers (padding rows get slot -1, so they write no KV, and block 0, which they only read);
- every launch is planned for the longest context the server allows (`max_seq_len` = the context
  limit), so one graph serves every context length: splits a row does not reach find no blocks;
- the logits of the real rows are a view of the graph's static output, consumed by the sampler
  before the next replay.

Steps with a prefill chunk, more rows than the ladder's top or a longer context run eagerly. The
sampler stays outside the graph: its host work (per-row plans, a data-dependent second pass for
flat top-p rows) is not capturable, and its device work is a few kernels, not hundreds.

`capture` is injectable: `cuda_capture` on a GPU; tests pass one that re-runs the captured
function over the same static buffers, which checks everything but the CUDA graph itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .attention.metadata import AttentionMetadata
from .host_tensor import host_tensor
from .step import StepBatch
from .step_inputs import StepInputs

log = logging.getLogger("ringserve.gpu")


def ladder(max_rows: int) -> list[int]:
    """Padded row counts with a graph: 1, 2, 4, 8, then every multiple of 8 up to max_rows."""
    sizes = [s for s in (1, 2, 4) if s < max_rows] + list(range(8, max_rows, 8)) + [max_rows]
    return sorted(set(sizes))


class Replay(Protocol):
    output: torch.Tensor

    def replay(self) -> None: ...


@dataclass
class CudaReplay:
    graph: torch.cuda.CUDAGraph
    output: torch.Tensor

    def replay(self) -> None:
        self.graph.replay()


def cuda_capture(fn: Callable[[], torch.Tensor], pool) -> CudaReplay:
    """Capture `fn` into a CUDA graph (after one eager run on a side stream, as torch requires)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return CudaReplay(graph, out)


class StaticStep:
    """Device buffers for up to `rows` decode rows with contexts up to `max_blocks` blocks."""

    def __init__(self, rows: int, max_blocks: int, block_size: int, device: torch.device) -> None:
        i64: dict[str, Any] = {"dtype": torch.int64, "device": device}
        i32: dict[str, Any] = {"dtype": torch.int32, "device": device}
        self.rows, self.max_blocks, self.block_size = rows, max_blocks, block_size
        self.ids = torch.zeros(rows, **i64)
        self.positions = torch.zeros(rows, **i64)
        self.slots = torch.full((rows,), -1, **i64)
        self.seq_lens = torch.ones(rows, **i32)
        self.tables = torch.zeros((rows, max_blocks), **i32)
        # One token per row: these never change.
        self.token_seq = torch.arange(rows, **i64)
        self.logits_indices = torch.arange(rows, **i64)
        self.query_start_loc = torch.arange(rows + 1, **i32)

    def inputs(self, size: int) -> StepInputs:
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            block_tables=self.tables[:size],
            positions=self.positions[:size],
            token_seq=self.token_seq[:size],
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            block_size=self.block_size,
        )
        return StepInputs(self.ids[:size], self.logits_indices[:size], meta)

    def fill(self, batch: StepBatch, size: int) -> None:
        """Copy a decode batch into the first `size` rows; rows past the batch become padding."""
        bs = self.block_size
        seqs = batch.seqs
        pad = size - len(seqs)
        starts = [s.start_pos for s in seqs]
        nblocks = [p // bs + 1 for p in starts]
        width = max(nblocks)
        ids = [s.token_ids[0] for s in seqs] + [0] * pad
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, starts)] + [-1] * pad
        table: list[int] = []
        zeros = [0] * width
        for s, nb in zip(seqs, nblocks):
            table += s.block_table[:nb] + zeros[nb:]
        table += zeros * pad
        flat = host_tensor("q", ids + (starts + [0] * pad) + slots)
        flat32 = host_tensor("i", [p + 1 for p in starts] + [1] * pad + table)
        dev = self.ids.device
        flat, flat32 = flat.to(dev, non_blocking=True), flat32.to(dev, non_blocking=True)
        self.ids[:size].copy_(flat[:size])
        self.positions[:size].copy_(flat[size : 2 * size])
        self.slots[:size].copy_(flat[2 * size :])
        self.seq_lens[:size].copy_(flat32[:size])
        # NOTE: columns past `width` keep older block ids; no row reads past its own context.
        self.tables[:size, :width].copy_(flat32[size:].view(size, width))


class DecodeGraphs:
    """Captured decode forwards of `runner` for each size of the ladder up to `max_rows`."""

    def __init__(
        self,
        runner,
        max_rows: int,
        context_limit: int,
        capture: Callable[[Callable[[], torch.Tensor], object], Replay] = cuda_capture,
    ) -> None:
        bs = runner.block_size
        self.runner = runner
        self.sizes = ladder(max_rows)
        self.max_blocks = -(-context_limit // bs)
        self.static = StaticStep(self.sizes[-1], self.max_blocks, bs, runner.device)
        self._capture = capture
        self.graphs: dict[int, Replay] = {}
        self.replays = 0

    def capture_all(self, progress: Callable[[], None] | None = None) -> float:
        """Capture every size, largest first (the smaller graphs reuse its memory pool); seconds."""
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle() if self.runner.device.type == "cuda" else None
        for size in reversed(self.sizes):
            inputs = self.static.inputs(size)

            def forward(inputs=inputs) -> torch.Tensor:
                # NOTE: cleared on every call (warm-up run, capture), so the block-table value check
                # (cupy_checks.check_block_tables) is recorded in the graph and runs on every replay.
                inputs.meta.checked_num_blocks = 0
                return self.runner.forward(inputs)

            self.graphs[size] = self._capture(forward, pool)
            if progress is not None:
                progress()
        elapsed = time.perf_counter() - t0
        log.info("captured %d decode graphs (rows %s) in %.1f s", len(self.sizes), self.sizes, elapsed)
        return elapsed

    def size_for(self, batch: StepBatch) -> int | None:
        """The graph size a batch replays on, or None when it must run eagerly."""
        n = len(batch.seqs)
        if not self.graphs or n > self.sizes[-1]:
            return None
        for s in batch.seqs:
            if len(s.token_ids) != 1 or s.sampling is None or s.start_pos // self.static.block_size >= self.max_blocks:
                return None
        return next(size for size in self.sizes if size >= n)

    def run(self, batch: StepBatch, size: int) -> torch.Tensor:
        """Replay the graph of `size` for a decode batch; logits `[rows, vocab]` (a view)."""
        self.static.fill(batch, size)
        graph = self.graphs[size]
        graph.replay()
        self.replays += 1
        return graph.output[: len(batch.seqs)]
