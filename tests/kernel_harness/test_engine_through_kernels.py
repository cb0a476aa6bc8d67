"""The tiny models end to end through the kernels: the engine's own runner and sampler, with the
attention backend's launchers running the CUDA source on the CPU harness, give the CPU engine's
greedy and seeded tokens (fp32); in fp16/bf16 their logits match the reference backend's."""

from __future__ import annotations

import random

import pytest
import torch

from ringserve.gpu_proc.attention import kernels_backend, reference_backend
from ringserve.gpu_proc.attention.cupy_backend import AttentionKernels
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import OfflineRequest, generate
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from ringserve.shm.messages import SamplingParams

from .executor import HarnessExecutor


def _runner(model_dir, dtype=torch.float32, harness: HarnessExecutor | None = None, num_blocks=96) -> ModelRunner:
    model = load_model(model_dir, "cpu", dtype)
    backend = reference_backend() if harness is None else kernels_backend(AttentionKernels(harness), "harness")
    model.setup("cpu", backend)
    a = model.args
    pool = KVPool(a.num_layers, num_blocks, a.num_kv_heads, a.head_dim, dtype=model.dtype)
    return ModelRunner(model, pool)


def _requests(vocab: int, lengths, temperature=0.0, max_tokens=8) -> list[OfflineRequest]:
    rng = random.Random(sum(lengths))
    return [
        OfflineRequest(
            prompt_ids=[rng.randrange(3, vocab) for _ in range(n)],
            max_tokens=max_tokens,
            sampling=SamplingParams(
                temperature=temperature, top_p=0.9 if temperature else 1.0, seed=i, ignore_eos=True
            ),
        )
        for i, n in enumerate(lengths)
    ]


def _tokens(runner, requests, **kw) -> list[list[int]]:
    return [r.token_ids for r in generate(runner, requests, eos_token_ids=frozenset(), **kw)]


@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_mha_model_dir"])
def test_tiny_models_through_the_kernels_give_the_cpu_engines_tokens(fixture, request):
    """Greedy and seeded tokens through the kernels (chunked prompts, shuffled blocks, decode rows
    beside chunks) equal the CPU reference engine's, token for token."""
    model_dir = request.getfixturevalue(fixture)
    cpu = _runner(model_dir)
    harness = HarnessExecutor(order="random", seed=7, sm_count=2, ctas_per_sm=2)
    kernels = _runner(model_dir, harness=harness)
    vocab = cpu.model.args.vocab_size
    for temperature in (0.0, 0.8):
        reqs = _requests(vocab, [5, 40, 70, 1], temperature=temperature)
        want = _tokens(cpu, reqs, prefill_budget=32, block_seed=1)
        got = _tokens(kernels, reqs, prefill_budget=32, block_seed=2)
        assert got == want, f"temperature {temperature}"
    launched = set(harness.launches)
    assert {n.split("<")[0] for n in launched} >= {"rs_kv_append", "rs_paged_decode", "rs_paged_prefill"}


def _mixed_steps(vocab: int) -> list[StepBatch]:
    """A prefill step (three chunks, one not sampling) then a mixed step (two decode rows and a chunk)."""
    rng = random.Random(0)
    ids = [[rng.randrange(3, vocab) for _ in range(n)] for n in (40, 23, 70)]
    greedy = RowSampling(temperature=0.0)
    tables = [[3, 9, 4], [7, 1], [12, 2, 8, 5, 11]]
    first = StepBatch(
        [
            SeqStep(0, ids[0], 0, tables[0], greedy),
            SeqStep(1, ids[1], 0, tables[1], greedy),
            SeqStep(2, ids[2][:50], 0, tables[2], None),
        ]
    )
    second = StepBatch(
        [
            SeqStep(0, [ids[0][-1]], 40, tables[0], greedy),
            SeqStep(1, [ids[1][-1]], 23, tables[1], greedy),
            SeqStep(2, ids[2][50:], 50, tables[2], greedy),
        ]
    )
    return [first, second]


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 0.02), (torch.bfloat16, 0.08)])
def test_half_precision_logits_match_the_reference_backend(tiny_model_dir, dtype, tol):
    """In fp16/bf16 the kernels and the torch reference give the same logits for the same model."""
    kernels = _runner(tiny_model_dir, dtype, harness=HarnessExecutor(order="reverse"), num_blocks=16)
    ref = _runner(tiny_model_dir, dtype, num_blocks=16)
    for batch in _mixed_steps(kernels.model.args.vocab_size):
        got, want = kernels.execute(batch), ref.execute(batch)
        assert torch.isfinite(got).all()
        err = (got - want).abs().max().item()
        assert err <= tol * (1 + want.abs().max().item()), f"max logit difference {err}"
