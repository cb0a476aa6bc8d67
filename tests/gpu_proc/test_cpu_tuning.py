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


def test_tune_rejects_negative_threads():
    """A negative count is a configuration error, not a silent default."""
    with pytest.raises(ValueError, match="cpu_threads"):
        tune_cpu_process(-1)


def test_zero_threads_means_every_cpu_the_process_may_use():
    """cpu_threads 0 (the default) gives torch one thread per CPU of the process's affinity."""
    import os

    before = torch.get_num_threads()
    try:
        assert tune_cpu_process(0) == len(os.sched_getaffinity(0)) == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_glibc_accepts_the_thresholds():
    """On glibc the mmap and trim thresholds are accepted."""
    assert keep_freed_memory() is True


def test_cpu_engine_applies_config_cpu_threads(tiny_model_dir):
    """Building the engine on the CPU leaves torch with `config.cpu_threads` threads."""
    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        build_executor(Config(device="cpu", num_blocks=16, cpu_threads=1), tiny_model_dir)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_step_memory_is_kept_until_released():
    """Under the thresholds a big step's freed temporaries stay resident (the next step reuses
    them); release_free_memory, which the GPU loop calls when it goes idle, gives them back
    (issue 15: one 8,191-token prompt left the process 840 MiB larger for good)."""
    import subprocess
    import sys

    code = (
        "import torch\n"
        "from ringserve.gpu_proc.cpu_tuning import keep_freed_memory, release_free_memory\n"
        "def rss():\n"
        "    return int(open('/proc/self/statm').read().split()[1]) * 4096 >> 20\n"
        "keep_freed_memory()\n"
        "base = rss()\n"
        "for _ in range(3):\n"
        "    x = torch.ones(300 << 18)\n"  # 300 MiB of float32
        "    del x\n"
        "kept = rss()\n"
        "release_free_memory()\n"
        "print(base, kept, rss())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    base, kept, released = map(int, out.stdout.split())
    assert kept - base > 250 and released - base < 50, (base, kept, released)


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
