"""Paged attention backends: the torch reference (CPU, and the spec) and CuPy kernels on CUDA.

A backend is two functions with the signatures of `reference.write_kv` and
`reference.paged_attention`; `get_backend(device)` picks one for a device.
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
        return AttentionBackend("cupy", cupy_backend.write_kv, cupy_backend.paged_attention)
    return reference_backend()
