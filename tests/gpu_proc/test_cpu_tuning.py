"""CPU process settings: torch thread cap and the allocator thresholds."""

from __future__ import annotations

import platform

import pytest
import torch

from ringserve.gpu_proc.cpu_tuning import keep_freed_memory, tune_cpu_process


def test_tune_caps_torch_threads():
    """tune_cpu_process(n) leaves torch with n intra-op threads."""
    before = torch.get_num_threads()
    try:
        tune_cpu_process(1)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_tune_rejects_zero_threads():
    """Zero threads is a configuration error, not a silent default."""
    with pytest.raises(ValueError, match="cpu_threads"):
        tune_cpu_process(0)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_the_thresholds():
    """On glibc the mmap and trim thresholds are accepted."""
    assert keep_freed_memory() is True
