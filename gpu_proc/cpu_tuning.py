"""Process settings for running the model on the CPU: torch threads and the C allocator.

Both were measured on a 2-core machine where API workers share the cores with the GPU process:

- threads: one per CPU the rest of the machine leaves free is the default (`cpu_threads` 0,
  `CpuShare`). Before the kernels were compiled with OpenMP only torch's own ops ran threaded, and
  torch's default of one thread per core made a single 50-token stream take 1.5 s instead of
  0.2-0.3 s (its threads spun against the workers); with the kernels' own parallel regions two
  threads beat one at 1, 8 and 32 streams (docs/BENCHMARKS.md, "One model thread or two"), where
  the API worker and the client took ~0.05 of a core. Beside two busy processes, though, two
  threads ran 4-10x fewer steps than one and each step up to 20x longer than the cost model said:
  a parallel region ends at its slowest thread, and a thread that lost its core stalls the other
  (docs/BENCHMARKS.md, "Model threads on a shared machine"). More threads than CPUs slows every
  step.
- a step's big temporaries (gathered K/V blocks, scores) are tens of MB. glibc serves blocks above
  its mmap threshold (at most 32 MB by its own adaptation) with fresh `mmap`s and returns them on
  free, so every step page-faults its working set in again: gathering 34 MB took 23 ms instead of
  4 ms. Raising the mmap and trim thresholds keeps freed memory in the heap for the next step. The
  cost is that the process keeps its peak step working set resident while it is busy: one
  8,191-token prompt (2,048-token chunks against up to 8,191 keys) took the tiny model's process
  from 363 to 1,206 MiB, 840 MiB of it free heap. Serving big temporaries from `mmap` instead
  (threshold 64 MiB) released it but made that prefill 2.5x slower, so the loop calls
  `release_free_memory` when it goes idle instead: the next busy step faults its working set in
  once (milliseconds), and an idle server holds only what it uses.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform
import resource
import time

import torch

log = logging.getLogger("ringserve.gpu")

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
_KEEP_BYTES = 1 << 30


def tune_cpu_process(threads: int, pin: bool = False) -> int:
    """Set torch's intra-op threads (the CPU kernels' parallel regions) to `threads`, 0 meaning
    every CPU this process may run on, and keep freed step memory for reuse (glibc); with `pin`,
    bind the process to that many CPUs (see `pin_to_cpus`). Returns the thread count."""
    if threads < 0:
        raise ValueError(f"cpu_threads must be >= 0 (0: every CPU), got {threads}")
    threads = threads or available_cpus()
    torch.set_num_threads(threads)
    keep_freed_memory()
    if pin:
        pin_to_cpus(threads)
    return threads


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, which a container's cpuset narrows)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def pin_to_cpus(count: int) -> set[int] | None:
    """Bind this process to the first `count` CPUs it may run on, when it may run on more; the
    CPUs chosen, or None (nothing to gain, or the OS refused).

    Measured on the shared 2-vCPU machine of docs/BENCHMARKS.md: unpinned, the GPU process got
    0.6-0.8 of a core while other jobs ran, against 0.95 for vLLM's worker, which vLLM pins the same
    way (`VLLM_CPU_OMP_THREADS_BIND=auto`: first core for the model, the rest for its front end).
    A pinned busy task keeps its core, and the kernel's load balancer moves the movable tasks
    (API workers, other jobs) to the other cores. Off by default: servers started side by side on
    one machine (a test suite) would all pin to the same first CPU.
    """
    try:
        allowed = sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None
    if len(allowed) <= count:
        return None
    chosen = set(allowed[:count])
    try:
        os.sched_setaffinity(0, chosen)
    except OSError as exc:
        log.warning("could not pin the GPU process to CPUs %s: %s", sorted(chosen), exc)
        return None
    log.info("GPU process pinned to CPUs %s", sorted(chosen))
    return chosen


def keep_freed_memory() -> bool:
    """Ask glibc to serve large blocks from the heap and not to trim it; False where that is not
    glibc or it refused (then steps only run slower)."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    ok = bool(mallopt(_M_MMAP_THRESHOLD, _KEEP_BYTES)) and bool(mallopt(_M_TRIM_THRESHOLD, 2 * _KEEP_BYTES))
    if not ok:
        log.warning("glibc refused the malloc thresholds; CPU steps will page-fault their temporaries")
    return ok


def release_free_memory() -> bool:
    """Return the heap's free memory to the system (glibc `malloc_trim`); False where that is not
    glibc. Cheap (madvise of the free pages); call it when the loop goes idle."""
    if platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):
        return False


# -- threads that follow the machine's load ----------------------------------------------------


def threads_for(free_cpus: float, most: int) -> int:
    """The model threads for `free_cpus` CPUs' worth of time the other processes leave: one per
    free CPU, rounded, within [1, most]."""
    return min(max(int(free_cpus + 0.5), 1), most)


def read_cpu_ticks(cpus: set[int] | None = None) -> tuple[int, int] | None:
    """(busy, all) clock ticks summed over `cpus` (None: every CPU) from /proc/stat, busy counting
    what the hypervisor stole; None where there is no /proc/stat. Guest time is inside user time
    already, so it is not added again."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    busy = total = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (cpus is not None and int(name[3:]) not in cpus):
            continue
        user, nice, system, idle, iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        busy += user + nice + system + irq + softirq + steal
        total += user + nice + system + idle + iowait + irq + softirq + steal
    return (busy, total) if total else None


def own_cpu_s() -> float:
    """CPU seconds this process has used, every thread together."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class CpuShare:
    """The model's threads follow the CPUs the rest of the machine leaves free (`cpu_threads` 0
    on the CPU): every `WINDOW_S` of the loop it measures how much of its CPUs' time the other
    processes (API workers, clients, neighbours, the hypervisor's steal) took, and sets torch's
    threads to `threads_for` what is left, at most `most`. Fewer threads at once (a thread that
    loses its core stalls every parallel region), more only after `RAISE_AFTER` windows agree,
    so a neighbour's short pause does not flip the count back and forth. The cost model follows
    the change as it follows any change of the machine."""

    WINDOW_S = 0.5
    RAISE_AFTER = 2

    def __init__(self, most: int, set_threads=None, ticks=read_cpu_ticks, own=own_cpu_s, clock=time.monotonic):
        try:
            self.cpus: set[int] | None = set(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = None
        self.most = most
        self.threads = most
        self._set = set_threads or torch.set_num_threads
        self._ticks, self._own, self._clock = ticks, own, clock
        self._hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._higher = 0  # windows in a row that asked for more threads
        self._mark = self._sample()

    def _sample(self):
        ticks = self._ticks(self.cpus)
        return None if ticks is None else (self._clock(), ticks, self._own())

    def poll(self, force: bool = False) -> int | None:
        """Re-decide once a window has passed (`force`: now); the new thread count when it
        changed, else None. Cheap between windows (one clock read)."""
        if self._mark is None or (not force and self._clock() - self._mark[0] < self.WINDOW_S):
            return None
        then, now = self._mark, self._sample()
        if now is None:
            return None
        self._mark = now
        all_s = (now[1][1] - then[1][1]) / self._hz
        if all_s <= 0:
            return None
        cpus = len(self.cpus) if self.cpus else (os.cpu_count() or 1)
        others_s = max((now[1][0] - then[1][0]) / self._hz - (now[2] - then[2]), 0.0)
        free = cpus * (1.0 - others_s / all_s)
        want = threads_for(free, self.most)
        if want > self.threads:
            self._higher += 1
            if self._higher < self.RAISE_AFTER:
                return None
        self._higher = 0
        if want == self.threads:
            return None
        log.info("model threads %d -> %d: other processes took %.2f of %d CPUs", self.threads, want, cpus - free, cpus)
        self.threads = want
        self._set(want)
        return want
