"""The harness itself: each check it promises fires on a small kernel that breaks exactly that rule,
and the same kernels written correctly pass. Without these, a clean run of the real kernels would
prove nothing."""

from __future__ import annotations

import numpy
import pytest
import torch

from .build import HarnessBuildError, translate_asm
from .executor import HarnessExecutor, KernelFault, load

SOURCE = r"""
#define FULL 0xffffffffu
__global__ void ok_reduce(const float* __restrict__ in, float* __restrict__ out) {
    __shared__ float partial[4];
    float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    __syncthreads();
    if (threadIdx.x == 0) out[blockIdx.x] = partial[0] + partial[1] + partial[2] + partial[3];
}
__global__ void missing_barrier(const float* __restrict__ in, float* __restrict__ out) {
    __shared__ float partial[4];
    float v = in[blockIdx.x * blockDim.x + threadIdx.x];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(FULL, v, off);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = v;
    if (threadIdx.x == 0) out[blockIdx.x] = partial[0] + partial[1] + partial[2] + partial[3];
}
__global__ void barrier_in_branch(float* out) {
    if (threadIdx.x < 64) {
        __syncthreads();
    }
    out[threadIdx.x] = 1.f;
}
__global__ void two_barriers(float* out) {
    if (threadIdx.x < 64) {
        __syncthreads();
    } else {
        __syncthreads();
    }
    out[threadIdx.x] = 1.f;
}
__global__ void shuffle_in_branch(float* out) {
    float v = threadIdx.x;
    if (threadIdx.x % 2 == 0) {
        v = __shfl_xor_sync(FULL, v, 1);
    }
    __syncthreads();
    out[threadIdx.x] = v;
}
__global__ void shuffle_outside_mask(float* out) {
    float v = threadIdx.x;
    v = __shfl_xor_sync(0x0000ffffu, v, 16);
    out[threadIdx.x] = v;
}
__global__ void shuffle_different_masks(float* out) {
    float v = threadIdx.x;
    v = __shfl_xor_sync(threadIdx.x < 16 ? 0x0000ffffu : FULL, v, 1);
    out[threadIdx.x] = v;
}
__global__ void shuffle_after_exit(float* out) {
    if (threadIdx.x == 7) return;
    out[threadIdx.x] = __shfl_down_sync(FULL, 1.f * threadIdx.x, 1);
}
__global__ void write_past_end(float* out, const int n) {
    out[threadIdx.x + n] = 1.f;
}
__global__ void read_before_start(const float* __restrict__ in, float* __restrict__ out) {
    out[threadIdx.x] = in[(int)threadIdx.x - 1];
}
__global__ void write_to_input(const float* in) {
    const_cast<float*>(in)[threadIdx.x] = 0.f;
}
__global__ void takes_widths(float* out, const int n, const long long big, const float scale) {
    out[0] = n + big * scale;
}
__global__ void fp16_roundtrip(const unsigned short* __restrict__ in, float* __restrict__ out,
                               unsigned short* __restrict__ back) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(in[threadIdx.x]));
    out[threadIdx.x] = f;
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f * 3.f));
    back[threadIdx.x] = h;
}
"""
NAMES = [
    "ok_reduce",
    "missing_barrier",
    "barrier_in_branch",
    "two_barriers",
    "shuffle_in_branch",
    "shuffle_outside_mask",
    "shuffle_different_masks",
    "shuffle_after_exit",
    "write_past_end",
    "read_before_start",
    "write_to_input",
    "takes_widths",
    "fp16_roundtrip",
]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def module():
    return load(SOURCE, NAMES)


def _run(module, name, grid, block, args, order="forward"):
    HarnessExecutor(module, order=order, seed=1).launch(name, CPU, grid, block, args)


@pytest.mark.parametrize("order", ["forward", "reverse", "random"])
def test_a_correct_block_reduction_passes(module, order):
    """Shuffles plus a barrier give the exact sums in every thread order."""
    x = torch.arange(256, dtype=torch.float32)
    out = torch.zeros(2)
    _run(module, "ok_reduce", (2,), (128,), (x, out), order)
    assert out.tolist() == [x[:128].sum().item(), x[128:].sum().item()]


def test_a_missing_barrier_reads_nan_shared_memory(module):
    """Without the barrier, thread 0 reads partial sums no one has written yet: NaN, not zeros."""
    x = torch.arange(256, dtype=torch.float32)
    out = torch.zeros(2)
    _run(module, "missing_barrier", (2,), (128,), (x, out))
    assert out.isnan().all()


def test_a_barrier_some_threads_never_reach_is_reported(module):
    with pytest.raises(
        KernelFault,
        match=r"__syncthreads \(line \d+\) reached while 64 thread\(s\) of the block "
        r"have exited",
    ):
        _run(module, "barrier_in_branch", (1,), (128,), (torch.zeros(128),))


def test_threads_at_different_barriers_are_reported(module):
    with pytest.raises(KernelFault, match="threads wait at different __syncthreads calls"):
        _run(module, "two_barriers", (1,), (128,), (torch.zeros(128),))


def test_a_shuffle_inside_a_branch_is_reported(module):
    """Odd lanes skip the shuffle and go on to the barrier: the even lanes can never be answered."""
    with pytest.raises(KernelFault, match=r"__shfl_xor_sync .* lane 1 .* waits at __syncthreads"):
        _run(module, "shuffle_in_branch", (1,), (64,), (torch.zeros(64),))


def test_a_shuffle_reading_outside_its_mask_is_reported(module):
    with pytest.raises(KernelFault, match=r"lane 0 reads lane 16, which is not in mask 0x0000ffff"):
        _run(module, "shuffle_outside_mask", (1,), (32,), (torch.zeros(32),))


def test_lanes_with_different_masks_are_reported(module):
    for order in ("forward", "reverse", "random"):
        with pytest.raises(KernelFault, match="must (reach the same collective|use the same mask)"):
            _run(module, "shuffle_different_masks", (1,), (32,), (torch.zeros(32),), order)


@pytest.mark.parametrize("order", ["forward", "reverse"])
def test_a_shuffle_naming_an_exited_lane_is_reported(module, order):
    """Whether lane 7 exits before or after the others arrive, the shuffle that names it fails."""
    with pytest.raises(KernelFault, match="exited"):
        _run(module, "shuffle_after_exit", (1,), (32,), (torch.zeros(32),), order)


def test_an_overrun_faults_against_the_guard_page(module):
    """Forward order puts buffers flush against the page after them: one element past the end faults."""
    with pytest.raises(KernelFault, match=r"0 bytes past the end of buffer `out` \(128 bytes\)"):
        _run(module, "write_past_end", (1,), (32,), (torch.zeros(32), numpy.int32(1)), "forward")


def test_an_underrun_faults_against_the_guard_page(module):
    """Reverse order puts buffers right after the page before them: element -1 faults."""
    with pytest.raises(KernelFault, match=r"4 bytes before the start of buffer `in`"):
        _run(module, "read_before_start", (1,), (32,), (torch.zeros(32), torch.zeros(32)), "reverse")


def test_a_write_through_a_const_pointer_faults(module):
    with pytest.raises(KernelFault, match="const in the kernel's signature"):
        _run(module, "write_to_input", (1,), (32,), (torch.zeros(32),))


def test_argument_widths_and_kinds_are_checked(module):
    """A Python int for a 4-byte int, a Python float for a float, a number for a pointer: all refused."""
    out = torch.zeros(1)
    good = (out, numpy.int32(2), 3, numpy.float32(0.5))
    _run(module, "takes_widths", (1,), (1,), good)
    assert out.item() == 3.5
    for bad, match in [
        ((out, 2, 3, numpy.float32(0.5)), r"`n`, a 4-byte integer\) got a Python int"),
        ((out, numpy.int32(2), numpy.int32(3), numpy.float32(0.5)), r"`big`, a 8-byte integer"),
        ((out, numpy.int32(2), 3, 0.5), r"`scale`, a 4-byte float\) got a Python float"),
        ((out, numpy.int32(2), 3, numpy.int32(1)), r"`scale`"),
        ((12345, numpy.int32(2), 3, numpy.float32(0.5)), "pass a tensor"),
    ]:
        with pytest.raises(KernelFault, match=match):
            _run(module, "takes_widths", (1,), (1,), bad)
    with pytest.raises(KernelFault, match="3 arguments for 4 parameters"):
        _run(module, "takes_widths", (1,), (1,), good[:3])


def test_fp16_conversions_match_torch(module):
    """cvt.f32.f16 and cvt.rn.f16.f32 run through C++ _Float16 and round as torch does (to nearest even)."""
    halves = torch.tensor([0.0, -0.0, 1.0, 65504.0, 6.1e-5, 1e-7, float("inf"), 0.1, -2.5, 1 / 3], dtype=torch.float16)
    bits = halves.view(torch.int16).view(torch.uint16) if hasattr(torch, "uint16") else halves.view(torch.int16)
    n = halves.numel()
    out, back = torch.zeros(n), torch.zeros(n, dtype=torch.int16)
    _run(module, "fp16_roundtrip", (1,), (n,), (bits.view(torch.int16), out, back))
    assert torch.equal(out, halves.float())
    # FTZ (CuPy compiles with -ftz=true): a subnormal fp32 product flushes; the rest round as torch.
    want = (halves.float() * 3).half()
    assert torch.equal(back.view(torch.float16)[:5], want[:5]) and torch.equal(back.view(torch.float16)[6:], want[6:])


def test_unknown_or_compound_asm_is_refused():
    """Inline asm the harness cannot emulate fails the build, naming the line."""
    with pytest.raises(HarnessBuildError, match="line 2: no harness emulation for PTX `ld.global.nc.f32`"):
        translate_asm('int x;\nasm("ld.global.nc.f32 %0, [%1];" : "=f"(f) : "l"(p));\n')
    with pytest.raises(HarnessBuildError, match="single-instruction"):
        translate_asm('asm("cvt.f32.f16 %0, %1; cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));')


def test_asm_translation_keeps_lines_and_checks_constraints():
    """A translated statement keeps the source's line count; its operands are wrapped by constraint."""
    src = 'a;\nasm volatile("cvt.f32.f16 %0,\\n %1;"\n  : "=f"(f)\n  : "h"(x));\nb;'
    out = translate_asm(src)
    assert out.count("\n") == src.count("\n")
    assert "rs_ptx_cvt_f32_f16(::rs::ptx::out_f(f), ::rs::ptx::in_h(x))" in out


def test_two_builds_keep_their_own_shared_memory():
    """A second build (as a planted bug is) runs on its own __shared__ window, not the first's."""
    first = load(SOURCE, NAMES)
    second = load(SOURCE + "\n// a second build\n", NAMES)
    assert first.lib._name != second.lib._name
    for module in (first, second):
        x = torch.arange(128, dtype=torch.float32)
        out = torch.zeros(1)
        _run(module, "missing_barrier", (1,), (128,), (x, out))
        assert out.isnan().all()  # each window is NaN-filled before its block: no stale sums
        _run(module, "ok_reduce", (1,), (128,), (x, out))
        assert out.item() == x.sum().item()


def _memory_maps() -> int:
    with open("/proc/self/maps") as maps:
        return sum(1 for _ in maps)


def test_a_launch_leaves_no_memory_maps_behind():
    """Each thread stack's guard page splits a mapping; kept per library, a session's hundreds of
    builds ran out of the kernel's ~65k maps (vm.max_map_count) and every later mmap failed."""
    module = load(SOURCE + "\n// a build of its own, launched for the first time here\n", NAMES)
    before = _memory_maps()
    for _ in range(3):
        x, out = torch.arange(128, dtype=torch.float32), torch.zeros(1)
        _run(module, "ok_reduce", (1,), (128,), (x, out))
    assert _memory_maps() - before < 64
