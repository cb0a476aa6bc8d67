"""The real kernels, run by the backend's own launchers on the CPU harness, against float64 attention.

Decode (batch 1-64, context 1-2,048, GQA groups 1/2/3/4/6/8, head dims 32/64/128, fp16/bf16/fp32,
forced and planned KV splits, q strided as a view of a fused projection, logits scaled x40/x60),
prefill and mixed steps (chunk and tile edges, a shared prefix, decode rows among chunks) and KV
append. Unused pool slots hold NaN. The quick matrix runs in `make test`; `make kernel-check` adds
the full one and runs every case in forward, reverse and random thread order.
"""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu_proc.attention.cupy_backend import AttentionKernels

from .cases import TOL, assert_close, decode_specs, make_case, oracle, strided_q
from .conftest import FULL, pick
from .executor import HarnessExecutor

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
ORDERS = ("forward", "reverse", "random")


def _kernels(case_id: int, order: str | None = None, **kw) -> AttentionKernels:
    """Launchers on the harness; without `order`, cases take turns over the three orders."""
    return AttentionKernels(HarnessExecutor(order=order or ORDERS[case_id % 3], seed=case_id, **kw))


def _orders(case_id: int) -> list[str]:
    return list(ORDERS) if FULL else [ORDERS[case_id % 3]]


DECODE = pick(
    [
        # batch, max context, heads, kv heads, head_dim, dtype, forced splits, logit scale
        (1, 1, 4, 4, 32, F32, None, 1.0),
        (3, 40, 8, 2, 64, F16, 2, 1.0),  # group 4
        (4, 300, 8, 1, 64, BF16, 3, 1.0),  # group 8: two CTAs per KV head, empty split tails
        (2, 100, 6, 2, 32, F16, None, 40.0),  # group 3, large logits
        (5, 70, 4, 2, 128, F32, 2, 1.0),  # the exact path, head dim 128
    ],
    [
        (1, 2048, 8, 2, 128, F16, None, 1.0),  # the planner splits a lone long row
        (1, 2048, 8, 8, 64, BF16, 8, 1.0),
        (16, 512, 8, 4, 64, BF16, None, 1.0),
        (64, 64, 4, 1, 32, F16, None, 1.0),  # batch 64
        (8, 257, 12, 2, 64, F16, 5, 60.0),  # group 6, block edge + 1
        (7, 33, 16, 2, 128, F32, 4, 1.0),  # group 8 in fp32
        (3, 1024, 4, 4, 128, BF16, 7, 40.0),
        (2, 16, 2, 2, 32, F16, 1, 1.0),  # exactly one block
    ],
)


@pytest.mark.parametrize("case_id", range(len(DECODE)))
def test_decode_matches_float64_attention(case_id):
    """The decode kernel (and its split merge) over shuffled block tables equals dense attention."""
    batch, ctx, heads, kv_heads, d, dtype, splits, logit = DECODE[case_id]
    q, kc, vc, meta, dense = make_case(
        decode_specs(batch, ctx, case_id), heads, kv_heads, d, dtype, seed=case_id, logit_scale=logit
    )
    scale = d**-0.5
    want = oracle(q, meta, dense, scale)
    for i, order in enumerate(_orders(case_id)):
        kernels = _kernels(case_id, order)
        q_in = strided_q(q, kv_heads) if i % 2 == case_id % 2 else q
        got = kernels.paged_decode(q_in, kc, vc, meta, scale, num_splits=splits)
        assert_close(got, want, dtype, f"decode case {case_id} ({order})")


PREFILL = pick(
    [
        # (cached, new) per sequence, heads, kv heads, head_dim, dtype, logit scale
        ([(0, 40), (9, 7), (3, 1)], 4, 2, 32, F32, 1.0),
        ([(0, 31), (0, 33), (15, 16), (16, 15)], 4, 1, 64, F16, 1.0),  # tile and block edges, group 4
        ([(40, 20), (45, 1), (3, 1), (0, 2)], 4, 1, 64, BF16, 1.0),  # decode rows among chunks
        ([(100, 40), (0, 70)], 6, 2, 128, BF16, 1.0),  # group 3 (21-token tensor-core tiles), 3 KV tiles
    ],
    [
        ([(0, 1)], 8, 8, 128, F16, 1.0),
        ([(0, 300), (100, 64), (5, 33), (400, 1), (17, 1)], 8, 2, 128, F16, 1.0),
        ([(0, 300), (100, 64), (5, 33), (400, 1), (17, 1)], 8, 2, 128, BF16, 1.0),
        ([(1000, 200)], 4, 4, 64, BF16, 1.0),
        ([(i, 1) for i in range(0, 600, 97)] + [(100, 200)], 6, 2, 64, BF16, 1.0),  # group 3, mixed
        ([(0, 64), (64, 64), (127, 65)], 8, 1, 32, F16, 1.0),  # group 8: 8-token tiles
        ([(0, 96)], 4, 2, 128, F32, 1.0),
        ([(63, 2), (0, 129)], 4, 2, 64, F16, 40.0),  # large logits on tensor cores
        ([(200, 50)], 12, 2, 64, BF16, 60.0),  # group 6
        ([(0, 70)], 64, 1, 32, F16, 1.0),  # group 64: one token per tensor-core tile
    ],
)


# sm_90 runs fp16/bf16 prefill on tensor cores; sm_75 on the CUDA-core kernel (also fp32's).
CAPABILITIES = ((9, 0), (7, 5))


@pytest.mark.parametrize("case_id", range(len(PREFILL)))
def test_prefill_and_mixed_steps_match_float64_attention(case_id):
    """Prefill tiles (tensor-core and CUDA-core kernels) attend causally inside the chunk and fully
    over the prefix; the decode kernel gives the same on any flat batch; the mixed dispatch writes
    every row exactly once."""
    specs, heads, kv_heads, d, dtype, logit = PREFILL[case_id]
    q, kc, vc, meta, dense = make_case(specs, heads, kv_heads, d, dtype, seed=100 + case_id, logit_scale=logit)
    scale = d**-0.5
    want = oracle(q, meta, dense, scale)
    for i, order in enumerate(_orders(case_id)):
        q_in = strided_q(q, kv_heads) if i % 2 == case_id % 2 else q
        for cap in CAPABILITIES if dtype != F32 else CAPABILITIES[:1]:
            kernels = _kernels(case_id, order, capability=cap)
            what = f"({order}, sm_{cap[0]}{cap[1]})"
            assert_close(kernels.paged_prefill(q_in, kc, vc, meta, scale), want, dtype, f"prefill {what}")
            assert_close(kernels.paged_attention(q_in, kc, vc, meta, scale), want, dtype, f"mixed {what}")
        kernels = _kernels(case_id, order)
        assert_close(kernels.paged_decode(q, kc, vc, meta, scale), want, dtype, f"decode on prefill ({order})")


@pytest.mark.parametrize("dtype", [F16, BF16])
def test_shared_prefix_blocks(dtype):
    """Sequences sharing their first blocks (n samples of one prompt) read the shared keys."""
    q, kc, vc, meta, dense = make_case(
        [(60, 1), (70, 1), (90, 1), (50, 20)], 8, 2, 64, dtype, seed=5, shared_prefix_blocks=3
    )
    want = oracle(q, meta, dense, 0.125)
    kernels = _kernels(5)
    assert_close(kernels.paged_attention(q, kc, vc, meta, 0.125), want, dtype, "shared tables")
    assert_close(kernels.paged_decode(q, kc, vc, meta, 0.125, num_splits=3), want, dtype, "shared, split")


@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_write_kv_is_bit_identical_to_the_reference(dtype):
    """KV append places each token's heads at slot // 16, offset slot % 16, from a strided view,
    skipping negative (padding) slots, exactly as the reference does."""
    gen = torch.Generator().manual_seed(3)
    num_blocks, kvh, d, t = 12, 2, 64, 40
    kc = torch.full((num_blocks, kvh, 16, d), float("nan"), dtype=dtype)
    vc = kc.clone()
    slots = torch.randperm(num_blocks * 16, generator=gen)[:t]
    slots[::7] = -1
    fused = torch.randn(t, 3 * kvh * d, generator=gen).to(dtype)  # like a fused qkv
    k = fused[:, kvh * d : 2 * kvh * d].view(t, kvh, d)  # [T, kvh, d], row stride 3 * kvh * d
    v = fused[:, 2 * kvh * d :].view(t, kvh, d)
    want_k, want_v = kc.clone(), vc.clone()
    from ringserve.gpu_proc.attention import reference

    reference.write_kv(k, v, want_k, want_v, slots)
    _kernels(3).write_kv(k, v, kc, vc, slots)

    def same(a, b):  # bit for bit
        return torch.equal(
            a.view(torch.int16 if a.element_size() == 2 else torch.int32),
            b.view(torch.int16 if b.element_size() == 2 else torch.int32),
        )

    assert same(kc, want_k) and same(vc, want_v)


def test_large_logits_stay_accurate_in_half_precision():
    """With logits scaled x60 the kernels stay within their normal tolerance of the oracle (fp32
    scores and softmax), where rounding Q.K^T to fp16 would not."""
    q, kc, vc, meta, dense = make_case(decode_specs(2, 200, 9), 4, 2, 64, F16, seed=9, logit_scale=60.0)
    want = oracle(q, meta, dense, 0.125)
    got = _kernels(9).paged_decode(q, kc, vc, meta, 0.125)
    err = (got.double() - want).abs().max().item()
    assert err <= TOL[F16][0] + TOL[F16][1] * want.abs().max().item()


def test_a_mixed_step_splits_its_decode_rows_by_their_own_count():
    """The split planner counts a mixed step's one-token rows, not its chunk's tokens: 6 long decode
    rows beside a 256-token chunk are split (the merge kernel runs), and the answer is exact."""
    specs = [(599, 1)] * 6 + [(0, 256)]
    q, kc, vc, meta, dense = make_case(specs, 4, 2, 32, F16, seed=21)
    assert meta.single_rows == 6
    executor = HarnessExecutor(order="random", seed=21, sm_count=16, ctas_per_sm=4)
    got = AttentionKernels(executor).paged_attention(q, kc, vc, meta, 32**-0.5)
    assert_close(got, oracle(q, meta, dense, 32**-0.5), F16, "mixed step, split decode rows")
    assert any(name.startswith("rs_decode_merge") for name in executor.launches)
