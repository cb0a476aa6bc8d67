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


def test_cpu_engine_applies_config_cpu_threads(tiny_model_dir):
    """Building the engine on the CPU leaves torch with `config.cpu_threads` threads."""
    from ringserve.config import Config
    from ringserve.gpu_proc.engine import build_engine

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build_engine(Config(device="cpu", num_blocks=16, cpu_threads=1), tiny_model_dir)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_pin_binds_to_the_first_cpus_only_when_there_are_more():
    """Pinning takes the first `count` allowed CPUs, and does nothing when no CPU would be left."""
    import os

    from ringserve.gpu_proc.cpu_tuning import pin_to_cpus

    before = os.sched_getaffinity(0)
    try:
        assert pin_to_cpus(len(before)) is None and os.sched_getaffinity(0) == before
        if len(before) > 1:
            chosen = pin_to_cpus(1)
            assert chosen == {min(before)} == os.sched_getaffinity(0)
    finally:
        os.sched_setaffinity(0, before)
