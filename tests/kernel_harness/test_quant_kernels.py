"""The quantized-projection kernels (quant_linear.cu), run by their launchers on the CPU harness.

Every format (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) in fp16, bf16 and fp32 activations: the dequantization
equals `quant.dequantize` bit for bit (a gathered row list with a bad id gives a NaN row), the GEMV
equals float64 `x @ dequantize(w).T` within the dtype's tolerance for row counts across its tile
edges, rows of a weight across its CTA edges and rows of blocks shorter and longer than a warp, x
strided, with and without a bias; each row's result is the same bits alone and in a batch; and
`linear` takes the GEMM path past GEMV_MAX_ROWS.
"""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu_proc.quant import dequantize
from ringserve.gpu_proc.quant_cuda import GEMV_MAX_ROWS, QuantKernels, random_blocks

from .conftest import pick
from .executor import HarnessExecutor

FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# atol (a fraction of the largest |output|), rtol: fp32 accumulation, then the output's rounding
TOL = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2), torch.float32: (2e-5, 1e-4)}
ORDERS = ("forward", "reverse", "random")


def kernels(seed: int) -> QuantKernels:
    return QuantKernels(HarnessExecutor(order=ORDERS[seed % 3], seed=seed))


def gemv_oracle(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ dequantize(blocks).double().T
    return out + bias.double() if bias is not None else out


def assert_gemv_close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    atol, rtol = TOL[dtype]
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = (got.double() - want).abs()
    bound = atol * max(1.0, float(want.abs().max())) + rtol * want.abs()
    assert bool((err <= bound).all()), f"{what}: max |err| {float(err.max()):.3g} exceeds the {dtype} tolerance"


CASES = pick(
    [
        # format, dtype, N, K, rows of x, bias, x strided
        ("Q4_0", torch.float16, 9, 96, 1, False, False),
        ("Q4_1", torch.bfloat16, 13, 1088, 9, True, False),  # 34 blocks: lanes take two
        ("Q5_0", torch.float32, 4, 576, 17, False, True),
        ("Q5_1", torch.float16, 7, 160, 8, True, True),
        ("Q8_0", torch.bfloat16, 5, 1088, 3, False, False),
        ("Q8_0", torch.float32, 6, 64, 16, True, False),
    ],
    [(f, d, 11, 1056, t, t % 2 == 1, t % 3 == 0) for f in FORMATS for d in DTYPES for t in (1, 7, 25)],
)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_gemv_matches_float64(case):
    fmt, dtype, n, k, t, with_bias, strided = CASES[case]
    gen = torch.Generator().manual_seed(case)
    blocks = random_blocks(fmt, n, k, gen)
    x = torch.randn(t, k + 8 * strided, generator=gen).to(dtype)[:, :k]  # strided: a row stride of k + 8
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    got = kernels(case).gemv(x, blocks, bias)
    assert_gemv_close(got, gemv_oracle(x, blocks, bias), dtype, f"{fmt} {dtype} N={n} K={k} T={t}")


@pytest.mark.parametrize("fmt", FORMATS)
def test_gemv_is_batch_invariant(fmt):
    """Row i of a 11-row product equals the same row alone, bit for bit."""
    gen = torch.Generator().manual_seed(7)
    blocks = random_blocks(fmt, 5, 1088, gen)
    x = torch.randn(11, 1088, generator=gen).to(torch.float16)
    k = kernels(1)
    batch = k.gemv(x, blocks)
    for i in (0, 8, 10):
        assert torch.equal(k.gemv(x[i : i + 1].clone(), blocks), batch[i : i + 1]), f"{fmt}: row {i} differs"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_dequantize_is_quant_dequantize_bit_for_bit(fmt, dtype):
    gen = torch.Generator().manual_seed(3)
    blocks = random_blocks(fmt, 6, 96, gen)
    k = kernels(2)
    assert torch.equal(k.dequantize(blocks, dtype), dequantize(blocks).to(dtype))
    rows = torch.tensor([5, 0, 0, 9, 3])  # 9: no such row
    got = k.dequantize(blocks, dtype, rows=rows)
    want = dequantize(blocks).to(dtype)
    assert torch.equal(got[[0, 1, 2, 4]], want[[5, 0, 0, 3]])
    assert torch.isnan(got[3]).all(), "a row index out of range must give NaN, not another row"


def test_linear_past_the_gemv_rows_is_the_dequantized_gemm():
    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks("Q4_1", 8, 64, gen)
    x = torch.randn(GEMV_MAX_ROWS + 3, 64, generator=gen)
    k = QuantKernels(HarnessExecutor())
    scratch = torch.empty(8 * 64 + 5)
    got = k.linear(x.view(1, GEMV_MAX_ROWS + 3, 64), blocks, scratch=scratch)
    assert got.shape == (1, GEMV_MAX_ROWS + 3, 8)
    assert k.executor.launches[-1].startswith("rs_qdequant")
    assert torch.equal(got[0], torch.nn.functional.linear(x, dequantize(blocks)))
    small = k.linear(x[:GEMV_MAX_ROWS], blocks)
    assert k.executor.launches[-1].startswith("rs_qgemv")
    assert_gemv_close(small, gemv_oracle(x[:GEMV_MAX_ROWS], blocks, None), torch.float32, "linear, GEMV rows")


def test_launcher_rejects_bad_arguments():
    gen = torch.Generator().manual_seed(1)
    blocks = random_blocks("Q8_0", 4, 64, gen)
    k = QuantKernels(HarnessExecutor())
    with pytest.raises(ValueError, match="expected \\[T, 64\\]"):
        k.gemv(torch.randn(2, 96), blocks)
    with pytest.raises(ValueError, match="bias"):
        k.gemv(torch.randn(2, 64), blocks, torch.randn(5))
    with pytest.raises(ValueError, match="not a quantized weight"):
        k.gemv(torch.randn(2, 64), blocks[..., :30])
    with pytest.raises(TypeError, match="dtype"):
        k.gemv(torch.randn(2, 64, dtype=torch.float64), blocks)


def test_linear_copies_rows_the_gemv_cannot_read():
    """A contiguous view 4 bytes off alignment is copied (not refused mid-step); one row of any
    stride is read as it is."""
    gen = torch.Generator().manual_seed(9)
    blocks = random_blocks("Q4_0", 8, 64, gen)
    x = torch.randn(3 * 64 + 1, generator=gen)[1:].view(3, 64)
    assert x.is_contiguous() and x.data_ptr() % 16
    k = QuantKernels(HarnessExecutor())
    assert_gemv_close(k.linear(x, blocks), gemv_oracle(x, blocks, None), torch.float32, "unaligned rows")
    one = torch.randn(1, 72, generator=gen)[:, :64]
    assert_gemv_close(
        k.gemv(one.as_strided((1, 64), (3, 1)), blocks), gemv_oracle(one, blocks, None), torch.float32, "one row"
    )
