"""The model runner on flat steps: batch invariance, chunked prefill, block copies, bad steps."""

from __future__ import annotations

import random
from dataclasses import replace

import msgspec
import pytest
import torch

from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model, read_special_tokens
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import OfflineRequest, StepRecord, generate
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import StepBatchError
from ringserve.shm.messages import SamplingParams


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return load_model(tiny_model_dir, device="cpu")


@pytest.fixture(scope="module")
def eos(tiny_model_dir):
    return read_special_tokens(tiny_model_dir).eos_token_ids


def _runner(model, num_blocks=512):
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, num_blocks, a.num_kv_heads, a.head_dim))


def _mixed_requests(vocab, n=32, seed=0, **sampling):
    """n prompts of mixed lengths (1 to 300 tokens) of random token ids; the long ones come last so
    they are still prefilling in chunks while the short ones decode."""
    rng = random.Random(seed)
    lens = [rng.randrange(1, 24) for _ in range(n - 8)] + [1, 2, 15, 16, 17, 33, 150, 300]
    return [
        OfflineRequest(
            prompt_ids=[rng.randrange(2, vocab) for _ in range(k)],
            max_tokens=rng.randrange(12, 20),
            sampling=SamplingParams(**{"temperature": 0.0, "seed": 0, "ignore_eos": True, **sampling}),
        )
        for k in lens
    ]


def _alone_vs_batched(model, eos, reqs):
    alone = [generate(_runner(model), [r], eos_token_ids=eos, prefill_budget=4096)[0].token_ids for r in reqs]
    log: list[StepRecord] = []
    # prefill_budget 32: the step budget rises 8x while few rows decode (`step_budget.py`), so 256
    # prompt tokens a step at first, and the long prompts are still prefilling as the short ones decode
    batched = generate(_runner(model), reqs, eos_token_ids=eos, prefill_budget=32, max_rows=32, block_seed=1, log=log)
    # The batched run really mixed: a full 32-row step, and steps with both prefill and decode rows.
    assert max(s.num_rows for s in log) == 32
    assert any(s.num_prefill_rows and s.num_decode_rows for s in log)
    return alone, [r.token_ids for r in batched]


def test_greedy_batch_invariance_32_mixed_rows(model, eos):
    """At temperature 0 every request gives the same tokens alone and in a 32-row mixed step."""
    alone, batched = _alone_vs_batched(model, eos, _mixed_requests(model.args.vocab_size))
    assert alone == batched


def test_seeded_batch_invariance_32_mixed_rows(model, eos):
    """Seeded sampling gives the same tokens alone and in a 32-row mixed step; seeds matter."""
    reqs = _mixed_requests(model.args.vocab_size, seed=1, temperature=0.9, top_p=0.95)
    reqs = [replace(r, sampling=msgspec.structs.replace(r.sampling, seed=i)) for i, r in enumerate(reqs)]
    alone, batched = _alone_vs_batched(model, eos, reqs)
    assert alone == batched
    reseeded = [replace(r, sampling=msgspec.structs.replace(r.sampling, seed=1000 + i)) for i, r in enumerate(reqs[:8])]
    other = [r.token_ids for r in generate(_runner(model), reseeded, eos_token_ids=eos)]
    assert other != batched[:8]


SEEDED = SamplingParams(temperature=1.0, seed=77, ignore_eos=True)


def test_recompute_after_preemption_continues_identically(model, eos):
    """A seeded request recomputed from prompt + its first tokens (as after preemption) continues
    with exactly the tokens it would have produced."""
    rng = random.Random(4)
    prompt = [rng.randrange(2, model.args.vocab_size) for _ in range(40)]
    full = generate(
        _runner(model),
        [OfflineRequest(prompt_ids=prompt, max_tokens=12, sampling=SEEDED)],
        eos_token_ids=eos,
    )[0].token_ids
    # Positions fix the randomness, so resuming from prompt + 5 tokens at the same positions matches.
    resumed = generate(
        _runner(model),
        [OfflineRequest(prompt_ids=prompt + full[:5], max_tokens=7, sampling=SEEDED)],
        eos_token_ids=eos,
    )[0].token_ids
    assert resumed == full[5:]


def test_logits_only_for_sampling_rows_in_batch_order(model):
    """A mid-prompt chunk returns no logits; sampling rows come back in batch order."""
    runner = _runner(model)
    seqs = [
        SeqStep(0, [5, 6, 7], 0, [0], RowSampling(temperature=0.0)),
        SeqStep(1, [8, 9], 0, [1]),  # a chunk that does not finish its prompt
        SeqStep(2, [10], 0, [2], RowSampling(temperature=0.0)),
    ]
    logits = runner.execute(StepBatch(seqs))
    assert logits.shape == (2, model.args.vocab_size) and logits.dtype == torch.float32
    alone = _runner(model).execute(StepBatch([SeqStep(2, [10], 0, [7], RowSampling(temperature=0.0))]))
    torch.testing.assert_close(logits[1], alone[0], atol=1e-5, rtol=1e-5)


def test_chunked_prefill_equals_whole_prefill(model):
    """A prompt prefilled in three chunks gives the last-token logits of one whole prefill."""
    ids = list(range(3, 60))
    whole = _runner(model).execute(StepBatch([SeqStep(0, ids, 0, [4, 2, 9, 1], RowSampling(temperature=0.0))]))
    runner = _runner(model)
    table = [7, 3, 11, 5]
    runner.execute(StepBatch([SeqStep(0, ids[:20], 0, table)]))
    runner.execute(StepBatch([SeqStep(0, ids[20:21], 20, table)]))
    last = runner.execute(StepBatch([SeqStep(0, ids[21:], 21, table, RowSampling(temperature=0.0))]))
    torch.testing.assert_close(last, whole, atol=1e-4, rtol=1e-4)


def test_bad_steps_are_refused(model):
    """Empty steps, empty rows, short block tables and over-long contexts raise clear errors."""
    runner = _runner(model)
    with pytest.raises(StepBatchError, match="empty"):
        runner.execute(StepBatch([]))
    with pytest.raises(StepBatchError, match="no new tokens"):
        runner.execute(StepBatch([SeqStep(0, [], 0, [0])]))
    with pytest.raises(StepBatchError, match="block table has 1 blocks, 2 needed"):
        runner.execute(StepBatch([SeqStep(0, [1] * 17, 0, [0])]))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        runner.execute(StepBatch([SeqStep(0, [1], 8192, list(range(513)))]))


def test_pool_must_match_model(model):
    """A KV pool shaped for another model is refused at construction."""
    with pytest.raises(ValueError, match="does not match"):
        ModelRunner(model, KVPool(model.args.num_layers + 1, 8, model.args.num_kv_heads, model.args.head_dim))


def test_offline_requests_answer_to_the_servers_rules():
    """An offline request's sampling settings are checked by the rule the server checks a body by."""
    with pytest.raises(ValueError, match="temperature must be between 0 and 2"):
        OfflineRequest(prompt_ids=[1], max_tokens=1, sampling=SamplingParams(temperature=3.0))
