"""Paged attention backends: the torch reference (CPU, and the spec) and CuPy kernels on CUDA.

A backend is two functions with the signatures of `reference.write_kv` and
`reference.paged_attention`; `get_backend(device)` picks one for a device. A backend whose kernels
are compiled at run time also has `compile(dtype, head_dim, num_heads, num_kv_heads, device,
progress)`, which the engine calls during its load so no step compiles (`warmup.py`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    write_kv: Callable
    paged_attention: Callable
    compile: Callable | None = None


def reference_backend() -> AttentionBackend:
    from . import reference

    return AttentionBackend("reference", reference.write_kv, reference.paged_attention)


def get_backend(device: torch.device | str) -> AttentionBackend:
    """The CuPy kernels on a CUDA device when CuPy imports, else the torch reference."""
    if torch.device(device).type == "cuda":
        try:
            import cupy  # noqa: F401

            from . import cupy_backend
        except ImportError:
            return reference_backend()
        return kernels_backend(cupy_backend.default_kernels())
    return reference_backend()


def kernels_backend(kernels, name: str = "cupy") -> AttentionBackend:
    """A backend over `cupy_backend.AttentionKernels` (CuPy on a GPU, or the CPU kernel harness)."""
    return AttentionBackend(name, kernels.write_kv, kernels.paged_attention, kernels.compile)
