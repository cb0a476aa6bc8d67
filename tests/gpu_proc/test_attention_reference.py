"""The torch reference paged attention and KV write: the spec the CUDA kernels are tested against."""

from __future__ import annotations

import random

import pytest
import torch

from ringserve.gpu_proc.attention import get_backend
from ringserve.gpu_proc.attention.reference import paged_attention, paged_attention_naive, write_kv
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import build_step_inputs
from tests.helpers.attention_cases import BS, run_case


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1)])
@pytest.mark.parametrize("trial", range(3))
def test_paged_equals_dense_for_random_block_tables(num_heads, num_kv_heads, trial):
    """Decode rows and prefill chunks over shuffled block ids give dense causal attention."""
    rng = random.Random(1000 * num_heads + 10 * num_kv_heads + trial)
    spec = [(rng.randrange(0, 70), 1) for _ in range(5)]  # decode rows
    spec += [(rng.randrange(0, 40), rng.randrange(2, 40)) for _ in range(3)]  # chunks, some first
    spec.append((0, 1))  # a one-token prompt
    paged, dense = run_case(spec, num_heads, num_kv_heads, 32, 128, rng)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


def test_blocks_shared_between_sequences():
    """Sequences that share prefix blocks each see the shared keys plus their own continuation."""
    rng = random.Random(7)
    spec = [(40, 1), (40, 3), (33, 1), (48, 17)]  # all reuse the first two blocks (32 tokens)
    paged, dense = run_case(spec, 4, 2, 16, 64, rng, shared_prefix=2)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


def test_token_never_sees_future_or_other_sequences():
    """Changing another sequence's keys, or this chunk's later keys, leaves a token's output alone."""
    pool = KVPool(1, 8, 1, 8)
    batch = StepBatch([SeqStep(0, [0] * 4, 0, [3]), SeqStep(1, [0] * 2, 0, [5])])
    meta = build_step_inputs(batch, BS, torch.device("cpu")).meta
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(6, 1, 8, generator=gen)
    k, v = torch.randn(6, 1, 8, generator=gen), torch.randn(6, 1, 8, generator=gen)
    write_kv(k, v, pool.k[0], pool.v[0], meta.slot_mapping)
    first = paged_attention(q, pool.k[0], pool.v[0], meta, 1.0)
    k2, v2 = k.clone(), v.clone()
    k2[3:], v2[3:] = 100.0, -100.0  # seq 0's last token and all of seq 1
    write_kv(k2, v2, pool.k[0], pool.v[0], meta.slot_mapping)
    second = paged_attention(q, pool.k[0], pool.v[0], meta, 1.0)
    torch.testing.assert_close(first[:3], second[:3])
    assert not torch.allclose(first[3:], second[3:])


def test_write_kv_lands_in_block_and_offset():
    """Slot block*16+offset of layout [blocks, kv_heads, 16, d] receives the token's key and value."""
    pool = KVPool(1, 4, 2, 8)
    k = torch.arange(2 * 2 * 8, dtype=torch.float32).view(2, 2, 8)
    write_kv(k, -k, pool.k[0], pool.v[0], torch.tensor([3 * 16 + 5, 1 * 16 + 15]))
    assert torch.equal(pool.k[0][3, :, 5], k[0]) and torch.equal(pool.k[0][1, :, 15], k[1])
    assert torch.equal(pool.v[0][3, :, 5], -k[0])
    assert int((pool.k[0] != 0).sum()) == k.numel() - 1  # k[0,0,0] is zero itself


def test_write_kv_rejects_mismatched_cache():
    """A cache whose head count or head size differs from the keys is refused before writing."""
    pool = KVPool(1, 4, 2, 8)
    with pytest.raises(ValueError, match="does not match"):
        write_kv(torch.zeros(1, 4, 8), torch.zeros(1, 4, 8), pool.k[0], pool.v[0], torch.tensor([0]))


def test_bfloat16_cache_matches_dense_within_bf16_tolerance():
    """A bfloat16 cache and queries give the float64 dense answer to bfloat16 precision."""
    paged, dense = run_case([(20, 1), (0, 9), (31, 2)], 4, 2, 32, 16, random.Random(3), dtype=torch.bfloat16)
    torch.testing.assert_close(paged, dense, atol=3e-2, rtol=3e-2)


def test_cpu_backend_without_kernels_is_the_reference():
    """On CPU with the compiled kernels off, get_backend returns the torch reference functions."""
    backend = get_backend("cpu", cpu_kernels=False)
    assert backend.name == "reference"
    assert backend.write_kv is write_kv and backend.paged_attention is paged_attention


def test_small_memory_budget_slices_tokens_with_same_result(monkeypatch):
    """With a tiny gather budget (token slices, and chunks falling back to per-token gathers) the
    result is unchanged."""
    from ringserve.gpu_proc.attention import reference

    spec = [(20, 1), (0, 9), (31, 2), (5, 1), (40, 20)]
    full, dense = run_case(spec, 4, 2, 16, 32, random.Random(11))
    monkeypatch.setattr(reference, "_GATHER_BUDGET_BYTES", 4096)
    sliced, _ = run_case(spec, 4, 2, 16, 32, random.Random(11))
    torch.testing.assert_close(sliced, full, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sliced, dense, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("attention", [paged_attention, paged_attention_naive])
def test_nan_in_unwritten_slots_never_reaches_the_output(attention):
    """A pool whose unwritten slots (block tails, padding blocks, block 0) are NaN gives the dense
    answer: garbage a token may not see is masked out of both the scores and the values."""
    spec = [(3, 1), (70, 1), (0, 5), (17, 30), (200, 1), (33, 2)]
    paged, dense = run_case(spec, 4, 2, 16, 64, random.Random(5), fill=float("nan"))
    assert not paged.isnan().any()
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("trial", range(3))
def test_fast_path_equals_naive_on_mixed_steps(trial):
    """Decode rows of very different contexts next to prefill chunks: the bucketed path gives the
    naive dense-gather answer."""
    rng = random.Random(50 + trial)
    spec = [(rng.choice([0, 5, 15, 16, 40, 130, 300]), 1) for _ in range(12)]
    spec += [(rng.randrange(0, 100), rng.randrange(2, 50)) for _ in range(2)]
    rng.shuffle(spec)
    fast, dense = run_case(spec, 8, 2, 16, 512, random.Random(trial))
    naive, _ = run_case(spec, 8, 2, 16, 512, random.Random(trial), attention=paged_attention_naive)
    torch.testing.assert_close(fast, naive, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(fast, dense, atol=1e-5, rtol=1e-4)


def test_decode_rows_pad_only_to_their_own_bucket():
    """Next to one 4,000-token row, short decode rows are gathered at most twice (or 8 blocks past)
    their own blocks, and a prefill chunk gathers only its own sequence's blocks."""
    from ringserve.gpu_proc.attention.reference_plan import build_reference_plan

    contexts = [10, 40, 4000, 20, 300, 600]  # 1, 3, 251, 2, 19, 38 blocks
    seqs = [SeqStep(i, [0], ctx, list(range(ctx // BS + 1))) for i, ctx in enumerate(contexts)]
    seqs.append(SeqStep(6, [0] * 8, 24, [0, 1]))
    meta = build_step_inputs(StepBatch(seqs), BS, torch.device("cpu")).meta
    plan = build_reference_plan(meta, num_kv_heads=1, row_bytes_per_block=1, budget_bytes=1 << 30)
    widths = {tuple(b.tokens.tolist()): b.ctx // BS for b in plan.decode}
    assert widths == {(0, 1, 3): 3, (4, 5): 38, (2,): 251}  # 1, 2, 3 | 19, 38 | 251 blocks
    assert [(c.lo, c.hi, c.seq_len, c.blocks.tolist()) for c in plan.chunks] == [(6, 14, 32, [0, 1])]


def test_cache_block_size_must_match_the_step():
    """A cache of 8-token blocks under block tables of 16-token blocks is refused, not misread."""
    meta = build_step_inputs(StepBatch([SeqStep(0, [0], 3, [1])]), BS, torch.device("cpu")).meta
    cache = torch.zeros(4, 1, 8, 8)
    with pytest.raises(ValueError, match="8 tokens"):
        paged_attention(torch.zeros(1, 1, 8), cache, cache, meta, 1.0)


def test_write_kv_skips_padding_slots():
    """A negative slot writes nothing (not block -1, the pool's last block), as in the kernel."""
    kc = torch.zeros(4, 2, BS, 8)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 2, 8)
    write_kv(k, k * 2, kc, vc, torch.tensor([-1, 5, -1]))
    assert kc[0, :, 5].eq(1).all() and vc[0, :, 5].eq(2).all()
    assert kc.sum().item() == 2 * 8 and kc[3].eq(0).all()


@pytest.mark.parametrize("dtype,tol", [(torch.float16, 2e-3), (torch.bfloat16, 2e-2)])
def test_half_precision_scores_accumulate_in_float32(dtype, tol):
    """With logits scaled x60 the reference stays near float64 attention: Q.K^T is not rounded to
    the cache dtype before the softmax (which put it 0.03 / 0.3 off)."""
    from tests.kernel_harness.cases import decode_specs, make_case, oracle

    q, kc, vc, meta, dense = make_case(decode_specs(3, 300, 2), 8, 2, 64, dtype, seed=2, fill=0.0, logit_scale=60.0)
    got = paged_attention(q, kc, vc, meta, 0.125)
    want = oracle(q, meta, dense, 0.125)
    assert (got.double() - want).abs().max().item() <= tol * max(1.0, want.abs().max().item())
