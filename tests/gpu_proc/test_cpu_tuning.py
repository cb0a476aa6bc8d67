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


def test_threads_for_rounds_the_free_cpus_within_bounds():
    """One thread per free CPU, rounded; never none, never more than asked."""
    from ringserve.gpu_proc.cpu_tuning import threads_for

    assert [threads_for(f, 2) for f in (0.0, 0.4, 1.0, 1.49, 1.5, 1.95, 5.0)] == [1, 1, 1, 1, 2, 2, 2]
    assert threads_for(11.6, 16) == 12


class _Machine:
    """Fake /proc/stat and rusage for CpuShare: two CPUs at 100 ticks a second, the model using
    `own` of them and other processes `others`."""

    def __init__(self) -> None:
        self.t, self.busy, self.all, self.own_s = 0.0, 0, 0, 0.0

    def run(self, seconds: float, own: float, others: float) -> None:
        self.t += seconds
        self.all += round(2 * 100 * seconds)
        self.busy += round((own + others) * 100 * seconds)
        self.own_s += own * seconds


def _share(machine: _Machine, set_to: list[int]):
    from ringserve.gpu_proc.cpu_tuning import CpuShare

    share = CpuShare(
        2,
        set_threads=set_to.append,
        ticks=lambda _cpus: (machine.busy, machine.all),
        own=lambda: machine.own_s,
        clock=lambda: machine.t,
    )
    share.cpus = {0, 1}
    share._hz = 100
    return share


def test_cpu_share_drops_a_thread_at_once_and_takes_it_back_after_two_windows():
    """Other processes taking a CPU's worth drop the model to one thread in the first window; once
    they stop, the second thread comes back only after RAISE_AFTER windows agree, and a window
    between them that is busy again starts the count over."""
    machine, set_to = _Machine(), []
    share = _share(machine, set_to)
    machine.run(0.6, own=1.95, others=0.05)  # the API worker's share: both threads stay
    assert share.poll() is None and share.threads == 2
    machine.run(0.2, own=1.0, others=1.0)
    assert share.poll() is None  # within the window: nothing re-decided
    machine.run(0.4, own=1.0, others=1.0)
    assert share.poll() == 1 and share.threads == 1 and set_to == [1]
    machine.run(0.6, own=1.0, others=0.1)
    assert share.poll() is None and share.threads == 1  # one free window is not enough
    machine.run(0.6, own=1.0, others=1.0)
    assert share.poll() is None
    machine.run(0.6, own=1.0, others=0.1)
    assert share.poll() is None
    machine.run(0.6, own=1.0, others=0.1)
    assert share.poll() == 2 and set_to == [1, 2]


def test_cpu_share_counts_stolen_time_as_taken():
    """Time the hypervisor steals is time a model thread cannot run: busy, not free."""
    from ringserve.gpu_proc.cpu_tuning import read_cpu_ticks

    ticks = read_cpu_ticks()
    if ticks is None:
        pytest.skip("no /proc/stat")
    busy, total = ticks
    assert 0 <= busy <= total
    machine, set_to = _Machine(), []
    share = _share(machine, set_to)
    machine.run(0.6, own=1.2, others=0.8)  # others here: steal
    assert share.poll() == 1


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="one CPU: one thread either way")
def test_cpu_share_follows_real_busy_processes():
    """Measured on this machine: as many busy processes as CPUs take the model down to fewer
    threads than CPUs, and it gets them back once they end (killed in `finally`)."""
    import os
    import subprocess
    import time

    from ringserve.gpu_proc.cpu_tuning import CpuShare

    cpus = len(os.sched_getaffinity(0))
    set_to: list[int] = []
    share = CpuShare(cpus, set_threads=set_to.append)
    hogs = [subprocess.Popen(["sh", "-c", "while :; do :; done"]) for _ in range(cpus)]
    try:
        deadline = time.monotonic() + 10
        while share.threads == cpus and time.monotonic() < deadline:
            time.sleep(CpuShare.WINDOW_S)
            share.poll()
        assert share.threads < cpus, set_to
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    deadline = time.monotonic() + 10
    while share.threads < cpus and time.monotonic() < deadline:
        time.sleep(CpuShare.WINDOW_S)
        share.poll()
    assert share.threads == cpus, set_to
