"""Where the attention launchers' kernels run on a GPU: CuPy, NVRTC and torch's current stream.

`cupy_backend.AttentionKernels` plans every launch (grid, block, arguments) and hands it to an
executor. `CupyExecutor` is the production one: it compiles kernels with NVRTC through
`cupy.RawModule` (one module per kernel, so a model compiles only what it launches and a long load
can report progress between kernels; CuPy caches the binaries on disk), launches them on torch's
current stream through `cupy.cuda.ExternalStream` (so they order with the torch ops around them and
can be captured in a CUDA graph), and answers the occupancy questions the split planner asks. The
CPU execution harness (`tests/kernel_harness`) is the other executor: it runs the same source on
the CPU, so the launchers' argument lists are checked there too.

Kernel arguments are passed as CuPy converts them: a tensor as its device address, a Python int as
a 64-bit integer, numpy scalars at their own width. Importing this module needs neither CuPy nor
CUDA; `import cupy` happens at the first compile.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from .cupy_checks import require_cuda

log = logging.getLogger("ringserve.gpu")

# Passed to NVRTC as given; the CI test hands the same list to `nvcc -ptx` (CuPy adds -arch).
NVRTC_OPTIONS = ("--std=c++17",)


class KernelExecutor(Protocol):
    """What the launchers need from the place their kernels run."""

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """The tensor's device; raises ValueError when the executor cannot run on it."""

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """An output or scratch buffer (contents unspecified)."""

    def compile(self, names: Sequence[str], device: torch.device, progress: Callable[[], None] | None = None) -> None:
        """Make the named kernels ready to launch, calling `progress()` between kernels."""

    def launch(self, name: str, device: torch.device, grid: tuple, block: tuple, args: tuple) -> None:
        """Run kernel `name`; tensors in `args` are passed as their data address."""

    def sm_count(self, device: torch.device) -> int: ...

    def ctas_per_sm(self, name: str, device: torch.device, threads: int) -> int:
        """How many CTAs of `threads` threads of kernel `name` fit on one SM at once."""

    def capability(self, device: torch.device) -> tuple[int, int]: ...


class CupyExecutor:
    """Kernels from `source` compiled by NVRTC and launched on torch's current CUDA stream."""

    def __init__(self, source: Callable[[], str]) -> None:
        self._source = source
        self._functions: dict[tuple[int, str], Any] = {}  # cupy.RawKernel (cupy is imported lazily)
        self._occupancy: dict[tuple[int, str, int], int] = {}
        self.compiles_at_launch = 0  # kernels compiled by a launch rather than ahead of time

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return require_cuda(tensor)

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=device)

    def compile(self, names: Sequence[str], device: torch.device, progress: Callable[[], None] | None = None) -> None:
        index = _index(device)
        for name in names:
            self._function(index, name)
            if progress is not None:
                progress()

    def _function(self, index: int, name: str):
        fn = self._functions.get((index, name))
        if fn is None:
            import cupy

            with cupy.cuda.Device(index):
                module = cupy.RawModule(code=self._source(), options=NVRTC_OPTIONS, name_expressions=[name])
                fn = module.get_function(name)
            self._functions[(index, name)] = fn
        return fn

    def launch(self, name: str, device: torch.device, grid: tuple, block: tuple, args: tuple) -> None:
        import cupy

        index = _index(device)
        fn = self._functions.get((index, name))
        if fn is None:
            # NOTE: the engine compiles every kernel it launches during its load (warmup.py); a
            # compile here means a kernel was missed, and the step that pays for it is slow.
            self.compiles_at_launch += 1
            log.warning("compiling attention kernel %s at its first launch", name)
            fn = self._function(index, name)
        stream = _external_stream(torch.cuda.current_stream(device).cuda_stream, index)
        with cupy.cuda.Device(index), stream:
            fn(grid, block, tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))

    def sm_count(self, device: torch.device) -> int:
        return _device_properties(_index(device)).multi_processor_count

    def ctas_per_sm(self, name: str, device: torch.device, threads: int) -> int:
        index = _index(device)
        key = (index, name, threads)
        if key not in self._occupancy:
            self._occupancy[key] = _ctas_per_sm(self._function(index, name), threads, _device_properties(index))
        return self._occupancy[key]

    def capability(self, device: torch.device) -> tuple[int, int]:
        props = _device_properties(_index(device))
        return props.major, props.minor


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=64)
def _external_stream(stream_ptr: int, device_index: int):
    import cupy

    return cupy.cuda.ExternalStream(stream_ptr, device_index)


@functools.cache
def _device_properties(device_index: int):
    return torch.cuda.get_device_properties(device_index)


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources that bound how many CTAs are resident at once (sm_80 / sm_90 values)."""

    max_threads: int = 2048
    max_ctas: int = 32
    registers: int = 65536
    shared_bytes: int = 233472  # 228 KiB on sm_90 (164 KiB on sm_80)
    reserved_shared_per_cta: int = 1024  # the driver keeps 1 KiB per CTA on sm_80 and later
    register_granule: int = 256  # registers are allocated per warp in units of 256


def resident_ctas(num_regs: int, shared_bytes: int, threads: int, limits: SmLimits = SmLimits()) -> int:
    """CTAs of a kernel (`num_regs` registers per thread, `shared_bytes` static shared memory)
    resident on one SM: the smallest of the thread, CTA, register and shared-memory limits; at
    least 1. The occupancy calculator's arithmetic, so ptxas figures give the same answer offline."""
    warps = -(-threads // 32)
    regs_per_warp = -(-max(1, num_regs) * 32 // limits.register_granule) * limits.register_granule
    by_threads = limits.max_threads // (warps * 32)
    by_regs = limits.registers // (regs_per_warp * warps)
    by_shared = limits.shared_bytes // (shared_bytes + limits.reserved_shared_per_cta)
    return max(1, min(limits.max_ctas, by_threads, by_regs, by_shared))


def _sm_limits(props) -> SmLimits:
    default = SmLimits()
    return SmLimits(
        max_threads=getattr(props, "max_threads_per_multi_processor", default.max_threads),
        registers=getattr(props, "regs_per_multiprocessor", default.registers),
        shared_bytes=getattr(props, "shared_memory_per_multiprocessor", default.shared_bytes),
    )


def _ctas_per_sm(fn, threads: int, props) -> int:
    return resident_ctas(int(fn.num_regs), int(fn.shared_size_bytes), threads, _sm_limits(props))
