"""Process settings for running the model on the CPU: torch threads and the C allocator.

Both were measured on a 2-core machine where API workers share the cores with the GPU process:

- threads: one per CPU is the default (`cpu_threads` 0). Before the kernels were compiled with
  OpenMP only torch's own ops ran threaded, and torch's default of one thread per core made a
  single 50-token stream take 1.5 s instead of 0.2-0.3 s (its threads spun against the workers);
  with the kernels' own parallel regions two threads beat one at 1, 8 and 32 streams
  (docs/BENCHMARKS.md, "One model thread or two"). More threads than CPUs slows every step.
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
import platform

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
    import os

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
    import os

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
