"""LoRA adapters' deltas on CUDA: the launchers of `attention/kernels/lora_sgmv.cu`.

`LoraKernels.add_(x, y, a, bt, slot_of, segs)` is `LoraStep.delta` (`lora.py`, the spec) for one
projection of one layer: every token's row of y gets its adapter's `(x @ A^T) @ B^T`, all adapters
of the step in two launches (shrink to a float32 `[T, R]` scratch, expand into y), the base
model's tokens (slot -1) untouched. Like `QuantKernels` it plans each launch and hands it to an
executor: CuPy on a GPU, the CPU execution harness in tests (tests/kernel_harness/test_lora_kernels.py).
`check_lora_kernels` is the start-up check: the kernels against the reference on a small random
case; a failure serves the reference (`LoraStep.delta`'s torch ops) instead.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy
import torch

from .attention import cupy_backend

DTYPES = tuple(cupy_backend.TRAITS)
MAX_TARGETS = 3  # a fused group's projections (q|k|v)


def kernel_names(dtype: torch.dtype) -> list[str]:
    return [cupy_backend.lora_shrink_kernel(dtype), cupy_backend.lora_expand_kernel(dtype)]


def reference_add_(x, y, a, bt, slot_of: torch.Tensor) -> None:
    """The spec in float64 on the token's own slot: `y[t] += (x[t] @ a[s]^T) @ bt[s]` for
    `s = slot_of[t] >= 0` (B's zero blocks make the targets' columns their own)."""
    for t, s in enumerate(slot_of.tolist()):
        if s >= 0:
            delta = (x[t].double() @ a[s].double().t()) @ bt[s].double()
            y[t] = (y[t].double() + delta).to(y.dtype)


class LoraKernels:
    """The launchers, running their kernels on `executor` (`cupy_executor.KernelExecutor`)."""

    def __init__(self, executor) -> None:
        self.executor = executor

    def compile(self, dtype: torch.dtype, device: torch.device, progress: Callable[[], None] | None = None) -> None:
        self.executor.compile(kernel_names(dtype), torch.device(device), progress)

    def add_(
        self,
        x: torch.Tensor,
        y: torch.Tensor,
        a: torch.Tensor,
        bt: torch.Tensor,
        slot_of: torch.Tensor,
        segs: tuple[int, ...],
    ) -> None:
        """y [T, out] += each token's adapter delta, in place; x [T, in]; a [slots, R, in] and
        bt [slots, R, out] contiguous; slot_of int32 [T] (-1: the base model); `segs` the
        targets' output widths (summing to out, at most 3, R a multiple of their count)."""
        device = self.executor.device_of(y)
        if x.dtype not in DTYPES or any(t.dtype != x.dtype for t in (y, a, bt)):
            raise TypeError(f"lora: x, y, A and Bt must share one of {DTYPES}, got {x.dtype} {y.dtype} {a.dtype}")
        if any(t.device != device for t in (x, a, bt, slot_of)):
            raise ValueError("lora: every tensor must be on the device of y")
        if x.dim() != 2 or y.dim() != 2 or x.shape[0] != y.shape[0] or x.stride(1) != 1 or y.stride(1) != 1:
            raise ValueError(f"lora: x {tuple(x.shape)} and y {tuple(y.shape)} must be [T, *] rows of one T")
        if not (a.is_contiguous() and bt.is_contiguous()) or a.dim() != 3 or bt.dim() != 3:
            raise ValueError("lora: A and Bt must be contiguous [slots, R, *]")
        if a.shape[2] != x.shape[1] or bt.shape[:2] != a.shape[:2] or bt.shape[2] != y.shape[1]:
            raise ValueError(f"lora: A {tuple(a.shape)} / Bt {tuple(bt.shape)} do not fit {x.shape[1]} -> {y.shape[1]}")
        rank, out = a.shape[1], y.shape[1]
        if not 0 < len(segs) <= MAX_TARGETS or sum(segs) != out or rank % len(segs):
            raise ValueError(f"lora: segments {segs} do not split {out} columns and {rank} ranks")
        if slot_of.dtype != torch.int32 or slot_of.shape != (x.shape[0],) or not slot_of.is_contiguous():
            raise ValueError(f"lora: slot_of must be contiguous int32 [{x.shape[0]}]")
        t = x.shape[0]
        if t == 0 or rank == 0 or out == 0:
            return
        tmp = self.executor.empty((t, rank), torch.float32, device)
        self.executor.launch(
            cupy_backend.lora_shrink_kernel(x.dtype),
            device,
            (math.ceil(rank / cupy_backend.LORA_SHRINK_WARPS), t),
            (cupy_backend.LORA_SHRINK_WARPS * 32,),
            (x, x.stride(0), a, slot_of, tmp, numpy.int32(x.shape[1]), numpy.int32(rank)),
        )
        starts = [sum(segs[:i]) for i in range(1, len(segs))] + [out] * (MAX_TARGETS - len(segs))
        self.executor.launch(
            cupy_backend.lora_expand_kernel(x.dtype),
            device,
            (math.ceil(out / cupy_backend.LORA_EXPAND_COLS), t),
            (cupy_backend.LORA_EXPAND_COLS,),
            (
                y,
                y.stride(0),
                tmp,
                bt,
                slot_of,
                numpy.int32(out),
                numpy.int32(rank),
                numpy.int32(len(segs)),
                numpy.int32(starts[0]),
                numpy.int32(starts[1]),
            ),
        )


def default_kernels() -> LoraKernels:
    return LoraKernels(cupy_backend.CupyExecutor(cupy_backend.kernel_source))


def check_lora_kernels(kernels: LoraKernels, dtype: torch.dtype, device: torch.device) -> str | None:
    """None when the kernels match the float64 reference on a small random case of 3 slots, three
    targets and base-model tokens (untouched, bit for bit); else what differed."""
    gen = torch.Generator().manual_seed(36)
    segs, r, fan_in, t = (40, 8, 8), 3, 72, 11
    rank, out = r * len(segs), sum(segs)
    x = torch.randn(t, fan_in, generator=gen)
    y = torch.randn(t, out, generator=gen)
    a = torch.randn(3, rank, fan_in, generator=gen) / fan_in**0.5
    bt = torch.zeros(3, rank, out)
    col = 0
    for g, n in enumerate(segs):
        bt[:, g * r : (g + 1) * r, col : col + n] = torch.randn(3, r, n, generator=gen) / r**0.5
        col += n
    slot_of = torch.tensor([2, -1, 0, 1, 1, -1, 2, 0, 0, 1, -1], dtype=torch.int32)
    want = y.to(dtype).clone()
    reference_add_(x.to(dtype), want, a.to(dtype), bt.to(dtype), slot_of)
    got = y.to(dtype).to(device)
    kernels.add_(x.to(dtype).to(device), got, a.to(dtype).to(device), bt.to(dtype).to(device), slot_of.to(device), segs)
    got = got.cpu()
    base = slot_of < 0
    if not torch.equal(got[base], y.to(dtype)[base]):
        return "a base-model token's row changed"
    err = float((got.double() - want.double()).abs().max())
    tol = {torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 5e-2}[dtype]
    return None if err <= tol else f"max |error| {err:.3g} over {tol:g}"
