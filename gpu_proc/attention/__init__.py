"""Paged attention backends: the torch reference (the spec), compiled CPU kernels, CuPy kernels on CUDA.

A backend is two functions with the signatures of `reference.write_kv` and
`reference.paged_attention`; `get_backend(device, dtype)` picks one for a device. A backend whose
kernels are compiled at run time also has `compile(dtype, head_dim, num_heads, num_kv_heads,
device, progress)`, which the engine calls during its load so no step compiles (`warmup.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger("ringserve.gpu")


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    paged_attention: Callable
    compile: Callable | None = None


def reference_backend() -> AttentionBackend:
    from . import reference

    return AttentionBackend("reference", reference.write_kv, reference.paged_attention)


def compiled_cpu_backend(progress: Callable[[], None] | None = None) -> AttentionBackend:
    """The compiled CPU kernels, built first if this machine has no copy (raises CpuOpsUnavailable)."""
    from ..cpu_ext import load_cpu_ops
    from . import cpu_backend as cpu

    load_cpu_ops(progress)
    return AttentionBackend("cpu", cpu.write_kv, cpu.paged_attention)


def get_backend(
    device: torch.device | str, dtype: torch.dtype | None = None, *, cpu_kernels: bool = True
) -> AttentionBackend:
    """The CuPy kernels on a CUDA device when CuPy imports; on the CPU the compiled kernels for
    float32 and bfloat16 (unless `cpu_kernels` is off, or they cannot be built here: then a
    warning says why); else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            import cupy  # noqa: F401

            from . import cupy_backend
        except ImportError:
            return reference_backend()
        return kernels_backend(cupy_backend.default_kernels())
    if cpu_kernels and dtype in (None, torch.float32, torch.bfloat16):
        from ..cpu_ext import CpuOpsUnavailable

        try:
            return compiled_cpu_backend()
        except CpuOpsUnavailable as exc:
            log.warning("CPU kernels unavailable, using the torch reference attention (slower): %s", exc)
    return reference_backend()


def kernels_backend(kernels, name: str = "cupy") -> AttentionBackend:
    """A backend over `cupy_backend.AttentionKernels` (CuPy on a GPU, or the CPU kernel harness)."""
    return AttentionBackend(name, kernels.write_kv, kernels.paged_attention, kernels.compile)
