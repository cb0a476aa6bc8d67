"""CuPy attention kernels against a dense float64 oracle and the torch reference, on CUDA (the same
cases and oracle the CPU harness uses, `tests/kernel_harness/cases.py`).

Sweep: batch 1-256, context 1-8,192, shuffled and shared block tables, GQA ratios 1/4/8, head dims
32/64/128, fp16/bf16 (fp32 for the exact engine path), forced KV splits. Tolerance atol + rtol*|ref|.
Slots past every context are filled with NaN, so a kernel that reads (or multiplies) an unwritten
slot fails loudly. Sizes are chosen to keep the whole file to well under a minute on one GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from ringserve.gpu_proc.attention import cupy_backend, get_backend, reference  # noqa: E402
from tests.kernel_harness.cases import BS, TOL, decode_specs, make_case  # noqa: E402
from tests.kernel_harness.cases import assert_close as _assert_close  # noqa: E402
from tests.kernel_harness.cases import oracle as _oracle  # noqa: E402

DEV = torch.device("cuda")


def _case(specs, num_heads, num_kv_heads, head_dim, dtype, seed, shared_prefix_blocks=0, fill=float("nan")):
    return make_case(
        specs,
        num_heads,
        num_kv_heads,
        head_dim,
        dtype,
        seed,
        device=DEV,
        shared_prefix_blocks=shared_prefix_blocks,
        fill=fill,
    )


DECODE_CASES = [
    # batch, max context, heads, kv heads, head_dim, dtype, forced splits
    (1, 1, 8, 8, 128, torch.float16, None),
    (1, 8192, 32, 8, 128, torch.float16, None),  # split-KV by the planner
    (1, 8192, 32, 8, 128, torch.bfloat16, 7),
    (3, 17, 4, 1, 64, torch.bfloat16, None),  # GQA 4, partial blocks
    (7, 300, 32, 4, 128, torch.float16, 3),  # GQA 8, forced splits with empty tails
    (32, 1024, 32, 32, 128, torch.float16, None),
    (32, 1024, 32, 32, 128, torch.bfloat16, 2),
    (64, 4096, 32, 8, 128, torch.bfloat16, None),
    (256, 512, 8, 2, 64, torch.float16, None),
    (256, 2048, 16, 16, 64, torch.bfloat16, None),
    (5, 100, 4, 2, 32, torch.float32, None),  # the tiny model's shape, exact path
    (5, 100, 4, 2, 32, torch.float16, 2),
]


@pytest.mark.parametrize("batch,max_ctx,heads,kv_heads,head_dim,dtype,splits", DECODE_CASES)
def test_decode_matches_dense_oracle(batch, max_ctx, heads, kv_heads, head_dim, dtype, splits):
    """Decode attention over shuffled block tables equals dense attention within tolerance."""
    q, kc, vc, meta, dense = _case(
        decode_specs(batch, max_ctx, batch + max_ctx), heads, kv_heads, head_dim, dtype, seed=batch * 7 + max_ctx
    )
    scale = head_dim**-0.5
    got = cupy_backend.paged_decode(q, kc, vc, meta, scale, num_splits=splits)
    _assert_close(got, _oracle(q, meta, dense, scale), dtype, f"decode b{batch} ctx{max_ctx}")


PREFILL_CASES = [
    # (cached, new) per sequence, heads, kv heads, head_dim, dtype
    ([(0, 1)], 8, 8, 128, torch.float16),
    ([(0, 300), (1000, 256), (5, 33), (4000, 1), (17, 1)], 32, 8, 128, torch.float16),
    ([(0, 300), (1000, 256), (5, 33), (4000, 1), (17, 1)], 32, 8, 128, torch.bfloat16),
    ([(6144, 2048)], 32, 32, 128, torch.bfloat16),  # context 8,192
    ([(0, 31), (0, 32), (0, 33), (15, 16), (16, 15)], 8, 2, 64, torch.float16),  # tile edges
    ([(i, 1) for i in range(0, 2000, 97)] + [(100, 200)], 16, 4, 64, torch.bfloat16),  # mixed step
    ([(0, 40), (9, 7), (3, 1)], 4, 2, 32, torch.float32),
]


@pytest.mark.parametrize("specs,heads,kv_heads,head_dim,dtype", PREFILL_CASES)
def test_prefill_matches_dense_oracle(specs, heads, kv_heads, head_dim, dtype):
    """Prefill tiles attend causally inside the chunk and fully over the prefix, as dense attention."""
    q, kc, vc, meta, dense = _case(specs, heads, kv_heads, head_dim, dtype, seed=len(specs) * 13 + heads)
    scale = head_dim**-0.5
    want = _oracle(q, meta, dense, scale)
    _assert_close(cupy_backend.paged_prefill(q, kc, vc, meta, scale), want, dtype, "prefill")
    # The decode kernel is exact for any flat batch too: the same answer from the other path.
    _assert_close(cupy_backend.paged_decode(q, kc, vc, meta, scale), want, dtype, "decode on a prefill step")
    # The engine's entry point splits a mixed step between the two kernels; every row written once.
    _assert_close(cupy_backend.paged_attention(q, kc, vc, meta, scale), want, dtype, "mixed dispatch")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_shared_block_tables(dtype):
    """Sequences sharing their first blocks (n samples of one prompt) read the shared keys correctly."""
    specs = [(200, 1), (230, 1), (250, 1), (180, 20)]
    q, kc, vc, meta, dense = _case(specs, 32, 8, 128, dtype, seed=5, shared_prefix_blocks=8)
    scale = 128**-0.5
    want = _oracle(q, meta, dense, scale)
    _assert_close(cupy_backend.paged_attention(q, kc, vc, meta, scale), want, dtype, "shared tables")
    _assert_close(cupy_backend.paged_decode(q, kc, vc, meta, scale, num_splits=3), want, dtype, "shared, split")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_matches_the_torch_reference(dtype):
    """On a zero-initialised pool the kernels agree with `reference.paged_attention` (the spec)."""
    specs = [(0, 64), (100, 1), (33, 17), (2047, 1)]
    q, kc, vc, meta, _ = _case(specs, 8, 2, 64, dtype, seed=11, fill=0.0)
    scale = 0.125
    want = reference.paged_attention(q, kc, vc, meta, scale).double()
    atol, rtol = TOL[dtype]
    got = cupy_backend.paged_attention(q, kc, vc, meta, scale).double()
    # The reference rounds probabilities to the cache dtype before P.V; allow for that too.
    assert ((got - want).abs() <= 2 * atol + 2 * rtol * want.abs()).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_write_kv_places_every_token_in_its_slot(dtype):
    """KV append writes each token's heads to block slot // 16, offset slot % 16, from a strided view."""
    gen = torch.Generator(device=DEV).manual_seed(3)
    num_blocks, kvh, d, t = 64, 8, 128, 300
    kc = torch.zeros(num_blocks, kvh, BS, d, dtype=dtype, device=DEV)
    vc = torch.zeros_like(kc)
    slots = torch.randperm(num_blocks * BS, generator=gen, device=DEV)[:t]
    fused = torch.randn(t, 3 * kvh * d, generator=gen, device=DEV).to(dtype)  # like a fused qkv
    k = fused[:, kvh * d : 2 * kvh * d].view(t, kvh, d)  # [T, kvh, d], row stride 3 * kvh * d
    v = fused[:, 2 * kvh * d :].view(t, kvh, d)
    cupy_backend.write_kv(k, v, kc, vc, slots)
    want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
    reference.write_kv(k, v, want_k, want_v, slots)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_write_kv_skips_padding_slots():
    """A negative slot (padding) writes nothing."""
    kc = torch.zeros(4, 2, BS, 64, dtype=torch.float16, device=DEV)
    vc = torch.zeros_like(kc)
    k = torch.ones(2, 2, 64, dtype=torch.float16, device=DEV)
    cupy_backend.write_kv(k, k, kc, vc, torch.tensor([-1, 5], device=DEV))
    assert kc[0, :, 5].eq(1).all() and kc.sum().item() == 2 * 64


def test_launchers_reject_bad_arguments():
    """Wrong dtype, layout, head_dim or device fail before launch with the argument's name."""
    q, kc, vc, meta, _ = _case([(10, 2)], 8, 2, 64, torch.float16, seed=1, fill=0.0)
    with pytest.raises(TypeError, match="q: dtype"):
        cupy_backend.paged_attention(q.float(), kc, vc, meta, 0.1)
    with pytest.raises(ValueError, match="k_cache: must be contiguous"):
        cupy_backend.paged_attention(q, kc.transpose(1, 2).contiguous().transpose(1, 2), vc, meta, 0.1)
    with pytest.raises(ValueError, match="head_dim 48"):
        cupy_backend.paged_attention(q[..., :48], kc[..., :48].contiguous(), vc[..., :48].contiguous(), meta, 0.1)
    with pytest.raises(ValueError, match="q is on cpu"):
        cupy_backend.paged_attention(q.cpu(), kc, vc, meta, 0.1)
    with pytest.raises(ValueError, match="slot_mapping"):
        cupy_backend.write_kv(q[:, :2], q[:, :2], kc, vc, meta.slot_mapping[:1])


def test_get_backend_picks_cupy_on_cuda():
    """The engine's backend choice on a CUDA device is these kernels."""
    assert get_backend(DEV).name == "cupy"


def test_runs_on_torch_current_stream():
    """Kernels queue on torch's current stream: work on a side stream sees its own inputs."""
    q, kc, vc, meta, dense = _case([(500, 1), (20, 1)], 8, 8, 64, torch.float16, seed=9)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = cupy_backend.paged_attention(q, kc, vc, meta, 0.125)
    torch.cuda.current_stream().wait_stream(side)
    _assert_close(got, _oracle(q, meta, dense, 0.125), torch.float16, "side stream")
