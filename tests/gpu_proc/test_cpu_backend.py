"""The compiled CPU attention backend against its spec, the torch reference, over a sweep of shapes."""

from __future__ import annotations

import random

import pytest
import torch

from ringserve.gpu_proc.attention import get_backend, reference
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.step_inputs import build_step_inputs
from tests.helpers.attention_cases import BS, run_case

pytestmark = pytest.mark.usefixtures("cpu_kernels")


def _cpu_attention(*args):
    from ringserve.gpu_proc.attention import cpu_backend

    return cpu_backend.paged_attention(*args)


def _spec(rng: random.Random) -> list[tuple[int, int]]:
    """Decode rows, chunks longer than one 16-token tile, a first chunk and a one-token prompt."""
    spec = [(rng.randrange(0, 90), 1) for _ in range(5)]
    spec += [(rng.randrange(0, 40), rng.randrange(2, 40)) for _ in range(3)]
    return spec + [(0, 1), (0, 37)]


@pytest.mark.parametrize("head_dim", [8, 32, 40, 64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (8, 2), (4, 1), (9, 3)])
def test_matches_dense_attention_float32(head_dim, num_heads, num_kv_heads):
    """Every head size (unrolled ones and the general loop) and grouping gives dense causal attention."""
    rng = random.Random(head_dim * 100 + num_heads * 10 + num_kv_heads)
    paged, dense = run_case(_spec(rng), num_heads, num_kv_heads, head_dim, 128, rng, attention=_cpu_attention)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("head_dim", [32, 64, 40])
def test_bfloat16_matches_dense_and_the_reference(head_dim):
    """bfloat16 caches: the float64 dense answer to bfloat16 precision, and no further from it
    than the reference is (the kernel keeps scores and probabilities in float32)."""
    spec = _spec(random.Random(head_dim))
    paged, dense = run_case(spec, 8, 2, head_dim, 128, random.Random(1), dtype=torch.bfloat16, attention=_cpu_attention)
    ref, _ = run_case(spec, 8, 2, head_dim, 128, random.Random(1), dtype=torch.bfloat16)
    torch.testing.assert_close(paged, dense, atol=3e-2, rtol=3e-2)
    assert (paged - dense).abs().max() <= (ref - dense).abs().max() + 1e-2


@pytest.mark.parametrize("head_dim", [64, 40])
def test_float32_queries_over_a_bfloat16_cache(head_dim):
    """`--kv-cache-dtype bfloat16` under a float32 model: the dense answer to bfloat16 precision,
    as close as the reference over the same cache, and the same bits alone and in a batch."""
    spec = _spec(random.Random(head_dim + 1))
    kw = dict(dtype=torch.bfloat16, q_dtype=torch.float32)
    paged, dense = run_case(spec, 9, 3, head_dim, 128, random.Random(2), attention=_cpu_attention, **kw)
    ref, _ = run_case(spec, 9, 3, head_dim, 128, random.Random(2), **kw)
    torch.testing.assert_close(paged, dense, atol=3e-2, rtol=3e-2)
    assert (paged - dense).abs().max() <= (ref - dense).abs().max() + 1e-2
    alone, _ = run_case(spec[:1], 9, 3, head_dim, 128, random.Random(2), attention=_cpu_attention, **kw)
    assert torch.equal(alone, paged[: alone.shape[0]])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nan_in_unwritten_slots_never_reaches_the_output(dtype):
    """Unwritten slots full of NaN (block tails the kernel reads in whole 16-key chunks) are masked."""
    spec = [(3, 1), (70, 1), (0, 5), (17, 30), (200, 1), (33, 2)]
    paged, dense = run_case(
        spec, 4, 2, 64, 64, random.Random(5), dtype=dtype, fill=float("nan"), attention=_cpu_attention
    )
    assert not paged.isnan().any()
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(paged, dense, atol=tol, rtol=max(tol, 1e-4))


def test_blocks_shared_between_sequences():
    """Sequences sharing prefix blocks each see the shared keys plus their own continuation."""
    spec = [(40, 1), (40, 3), (33, 1), (48, 17)]
    paged, dense = run_case(spec, 4, 2, 16, 64, random.Random(7), shared_prefix=2, attention=_cpu_attention)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-4)


def _step(pool, seqs, gen):
    meta = build_step_inputs(StepBatch(seqs), BS, torch.device("cpu")).meta
    q = torch.randn(meta.num_tokens, 8, pool.head_dim, generator=gen)
    return q, meta


def test_a_token_gets_the_same_bits_alone_and_in_a_batch():
    """Batch invariance: a sequence's outputs are bitwise equal alone and next to other rows."""
    from ringserve.gpu_proc.attention import cpu_backend

    pool = KVPool(1, 64, 2, 64)
    gen = torch.Generator().manual_seed(0)
    pool.k_all.normal_(generator=gen)
    pool.v_all.normal_(generator=gen)
    mine = SeqStep(0, [0] * 21, 30, [5, 9, 2, 40])
    others = [SeqStep(1, [0], 70, [1, 3, 4, 6, 7]), SeqStep(2, [0] * 3, 10, [8])]
    q_alone, meta_alone = _step(pool, [mine], gen)
    alone = cpu_backend.paged_attention(q_alone, pool.k[0], pool.v[0], meta_alone, 0.125)
    q_batch, meta_batch = _step(pool, [others[0], mine, others[1]], gen)
    q_batch[1:22] = q_alone
    batched = cpu_backend.paged_attention(q_batch, pool.k[0], pool.v[0], meta_batch, 0.125)
    assert torch.equal(batched[1:22], alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_equals_the_reference_and_skips_padding(dtype):
    """The same slots as the reference's indexed assignment receive the same values; slot -1 is
    padding and writes nothing."""
    from ringserve.gpu_proc.attention import cpu_backend

    gen = torch.Generator().manual_seed(1)
    k = torch.randn(20, 3, 40, generator=gen).to(dtype)
    v = torch.randn(20, 3, 40, generator=gen).to(dtype)
    slots = torch.randperm(8 * BS, generator=gen)[:20]
    ours, ref = KVPool(1, 8, 3, 40, dtype=dtype), KVPool(1, 8, 3, 40, dtype=dtype)
    cpu_backend.write_kv(k, v, ours.k[0], ours.v[0], slots)
    reference.write_kv(k, v, ref.k[0], ref.v[0], slots)
    assert torch.equal(ours.k_all, ref.k_all) and torch.equal(ours.v_all, ref.v_all)
    before = ours.k_all.clone()
    cpu_backend.write_kv(k[:2] + 1, v[:2] + 1, ours.k[0], ours.v[0], torch.tensor([-1, -1]))
    assert torch.equal(ours.k_all, before)


def test_write_kv_rounds_float32_keys_into_a_bfloat16_cache_as_the_reference():
    from ringserve.gpu_proc.attention import cpu_backend

    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(20, 3, 64, generator=gen), torch.randn(20, 3, 64, generator=gen)
    slots = torch.randperm(8 * BS, generator=gen)[:20]
    ours, ref = KVPool(1, 8, 3, 64, dtype=torch.bfloat16), KVPool(1, 8, 3, 64, dtype=torch.bfloat16)
    cpu_backend.write_kv(k, v, ours.k[0], ours.v[0], slots)
    reference.write_kv(k, v, ref.k[0], ref.v[0], slots)
    assert torch.equal(ours.k_all, ref.k_all) and torch.equal(ours.v_all, ref.v_all)
    with pytest.raises(ValueError, match="differs from the cache"):
        cpu_backend.write_kv(k.bfloat16(), v.bfloat16(), KVPool(1, 8, 3, 64).k[0], KVPool(1, 8, 3, 64).v[0], slots)


def test_write_kv_takes_views_into_a_fused_projection():
    """k and v may be strided views (head_dim contiguous) of one qkv output."""
    from ringserve.gpu_proc.attention import cpu_backend

    qkv = torch.randn(5, (4 + 2 + 2) * 16)
    k, v = qkv[:, 64:96].view(5, 2, 16), qkv[:, 96:].view(5, 2, 16)
    pool = KVPool(1, 2, 2, 16)
    cpu_backend.write_kv(k, v, pool.k[0], pool.v[0], torch.arange(5) + 3)
    assert torch.equal(pool.k[0][0, :, 3:8].transpose(0, 1), k) and torch.equal(pool.v[0][0, :, 3:8].transpose(0, 1), v)


def test_bad_slots_and_blocks_are_errors_not_stray_accesses():
    """A slot or a block id outside the pool raises before memory outside it is touched."""
    from ringserve.gpu_proc.attention import cpu_backend

    pool = KVPool(1, 4, 1, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_backend.write_kv(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), pool.k[0], pool.v[0], torch.tensor([64]))
    meta = build_step_inputs(StepBatch([SeqStep(0, [0], 3, [7])]), BS, torch.device("cpu")).meta
    with pytest.raises(RuntimeError, match="outside the cache"):
        cpu_backend.paged_attention(torch.zeros(1, 1, 16), pool.k[0], pool.v[0], meta, 1.0)


def test_launcher_refuses_what_the_kernel_cannot_read():
    """Wrong dtype, a non-contiguous head dimension or a mismatched block size fail with ValueError."""
    from ringserve.gpu_proc.attention import cpu_backend

    pool = KVPool(1, 4, 2, 16)
    meta = build_step_inputs(StepBatch([SeqStep(0, [0], 3, [1])]), BS, torch.device("cpu")).meta
    with pytest.raises(ValueError, match="dtype"):
        cpu_backend.paged_attention(torch.zeros(1, 2, 16, dtype=torch.float64), pool.k[0], pool.v[0], meta, 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        cpu_backend.paged_attention(torch.zeros(1, 16, 2).transpose(1, 2), pool.k[0], pool.v[0], meta, 1.0)
    with pytest.raises(ValueError, match="8 tokens"):
        cache = torch.zeros(4, 2, 8, 16)
        cpu_backend.paged_attention(torch.zeros(1, 2, 16), cache, cache, meta, 1.0)
    with pytest.raises(ValueError, match="do not match"):
        cpu_backend.write_kv(torch.zeros(1, 4, 16), torch.zeros(1, 4, 16), pool.k[0], pool.v[0], torch.tensor([0]))


def test_get_backend_picks_the_kernels_for_float32_and_bfloat16():
    """On CPU: the compiled kernels for float32/bfloat16, the reference for float16 or when off."""
    assert get_backend("cpu").name == "cpu"
    assert get_backend("cpu", torch.bfloat16).name == "cpu"
    assert get_backend("cpu", torch.float16).name == "reference"
    assert get_backend("cpu", torch.float32, cpu_kernels=False).name == "reference"
