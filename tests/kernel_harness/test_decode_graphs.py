"""Decode graphs (cuda_graphs.py) on the CPU: the static buffers, padding rows and launch plan of a
graph replay, run through the kernels on the harness with a capture that re-runs the captured
forward over the same static buffers (everything but the CUDA graph object itself)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ringserve.gpu_proc.attention import kernels_backend, reference_backend
from ringserve.gpu_proc.attention.cupy_backend import AttentionKernels
from ringserve.gpu_proc.cuda_graphs import DecodeGraphs, ladder
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import OfflineRequest, generate
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from ringserve.shm.messages import SamplingParams

from .executor import HarnessExecutor


@dataclass
class EagerReplay:
    """A 'graph' whose replay calls the captured function again: same static inputs, same plan."""

    fn: Callable[[], torch.Tensor]
    output: torch.Tensor | None = None

    def replay(self) -> None:
        self.output = self.fn()


def _capture(fn, pool) -> EagerReplay:
    return EagerReplay(fn)


def _runner(model_dir, kernels: bool = True, num_blocks: int = 96) -> ModelRunner:
    model = load_model(model_dir, "cpu", torch.float32)
    backend = (
        kernels_backend(AttentionKernels(HarnessExecutor(sm_count=2, ctas_per_sm=2)), "harness")
        if kernels
        else reference_backend()
    )
    model.setup("cpu", backend)
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, num_blocks, a.num_kv_heads, a.head_dim))


def test_the_ladder():
    assert ladder(32) == [1, 2, 4, 8, 16, 24, 32]
    assert ladder(12) == [1, 2, 4, 8, 12]
    assert ladder(1) == [1]
    assert ladder(48)[-3:] == [32, 40, 48]


def test_replayed_decode_steps_give_the_eager_tokens(tiny_model_dir):
    """Greedy generation with decode steps replayed from graphs (padded rows, launches planned for
    the context limit) equals the CPU reference engine, token for token."""
    want_runner = _runner(tiny_model_dir, kernels=False)
    runner = _runner(tiny_model_dir)
    runner.graphs = DecodeGraphs(runner, max_rows=8, context_limit=512, capture=_capture)
    runner.graphs.capture_all()
    vocab = runner.model.args.vocab_size
    reqs = [
        OfflineRequest(
            prompt_ids=[(7 * i + 3 * j) % (vocab - 3) + 3 for j in range(n)],
            max_tokens=6,
            sampling=SamplingParams(temperature=0.0, ignore_eos=True),
        )
        for i, n in enumerate((5, 40, 1, 17, 3))
    ]
    want = [r.token_ids for r in generate(want_runner, reqs, eos_token_ids=frozenset(), prefill_budget=32)]
    got = [r.token_ids for r in generate(runner, reqs, eos_token_ids=frozenset(), prefill_budget=32, block_seed=4)]
    assert got == want
    assert runner.graphs.replays >= 4  # the decode-only steps replayed; prefill steps ran eagerly


def test_padding_rows_write_no_kv(tiny_model_dir):
    """Three rows replay on the 4-row graph: exactly their three slots change in every layer."""
    runner = _runner(tiny_model_dir)
    graphs = runner.graphs = DecodeGraphs(runner, max_rows=8, context_limit=256, capture=_capture)
    graphs.capture_all()
    pool = runner.kv_pool
    pool.k_all.fill_(7.0)
    greedy = RowSampling(temperature=0.0)
    batch = StepBatch(
        [SeqStep(0, [5], 20, [4, 9], greedy), SeqStep(1, [6], 3, [2], greedy), SeqStep(2, [7], 0, [11], greedy)]
    )
    assert graphs.size_for(batch) == 4
    logits = runner.execute(batch)
    assert logits.shape == (3, runner.model.args.vocab_size) and torch.isfinite(logits).all()
    changed = (pool.k_all != 7.0).any(-1).any(2)  # [layers, blocks, offsets]
    assert changed.sum().item() == 3 * pool.num_layers
    assert changed[:, 9, 4].all() and changed[:, 2, 3].all() and changed[:, 11, 0].all()


def test_steps_a_graph_cannot_serve_run_eagerly(tiny_model_dir):
    """A prefill chunk, a row that does not sample, too many rows or a context past the limit."""
    runner = _runner(tiny_model_dir)
    graphs = DecodeGraphs(runner, max_rows=4, context_limit=64, capture=_capture)
    graphs.capture_all()
    g = RowSampling(temperature=0.0)
    assert graphs.size_for(StepBatch([SeqStep(0, [1], 5, [0], g)])) == 1
    assert graphs.size_for(StepBatch([SeqStep(0, [1, 2], 5, [0], g)])) is None
    assert graphs.size_for(StepBatch([SeqStep(0, [1], 5, [0], None)])) is None
    assert graphs.size_for(StepBatch([SeqStep(i, [1], 5, [i], g) for i in range(5)])) is None
    assert graphs.size_for(StepBatch([SeqStep(0, [1], 64, [0, 1, 2, 3, 4], g)])) is None


def test_every_replay_checks_the_block_tables(tiny_model_dir):
    """The block-table value check is part of the captured forward: a bad block id in a replayed
    step is refused (on the GPU: a device-side assert inside the graph)."""
    import pytest

    runner = _runner(tiny_model_dir, num_blocks=16)
    runner.graphs = DecodeGraphs(runner, max_rows=2, context_limit=64, capture=_capture)
    runner.graphs.capture_all()
    g = RowSampling(temperature=0.0)
    runner.execute(StepBatch([SeqStep(0, [5], 3, [2], g)]))
    with pytest.raises(ValueError, match="block id 99, outside the pool of 16 blocks"):
        runner.execute(StepBatch([SeqStep(0, [5], 3, [99], g)]))


def test_a_step_that_scores_a_prompt_is_not_replayed(tiny_model_dir):
    """A one-token-per-row step in which a row scores a prompt token runs eagerly (a graph has no
    rows for scored positions' logits): sampling rows first, then the scored position."""
    from ringserve.gpu_proc.step import PromptScoring

    runner = _runner(tiny_model_dir, kernels=False)
    runner.graphs = DecodeGraphs(runner, max_rows=4, context_limit=64, capture=_capture)
    runner.graphs.capture_all()
    batch = StepBatch(
        [
            SeqStep(1, [5], 0, [3], RowSampling(temperature=0.0)),
            SeqStep(2, [7], 0, [4], None, PromptScoring(0, [9], 1)),
        ],
        scores_prompts=True,
    )
    logits = runner.execute(batch)
    assert logits.shape[0] == 2 and runner.graphs.replays == 0
    alone = runner.execute(StepBatch([SeqStep(3, [7], 0, [5], RowSampling(temperature=0.0))]))
    torch.testing.assert_close(logits[1], alone[0])
