"""The CPU kernels (`gpu_proc/csrc/*.cpp`): built once per machine as a torch extension, then loaded.

Why a C++ extension, and not `torch.compile`: the work that dominated a CPU step was gathering K/V
out of the paged cache (a copy of every row's context per layer per step), then a batched matmul
over the copy. Reading the blocks in place needs a loop over each sequence's block table, which
neither torch ops nor Inductor's generated code express without the gather; vLLM's CPU backend
uses hand-written C++ for the same reason. The small ops (RMSNorm, residual add, RoPE, SiLU-mul)
come along in the same extension, each one pass over the rows instead of 3-6 torch ops, and a whole
transformer block runs in one call. A `torch.compile` of the dense layers would need the step's
token count (new every step) bucketed and padded, one compilation per bucket before READY and in
CI, and would still leave attention to this extension; it was not measured here, but vLLM's
start-up, which compiles its model that way, took 39-62 s on the 2-vCPU machine of
docs/BENCHMARKS.md against 2-5 s for ringserve.

Build: `torch.utils.cpp_extension.load` (ninja, which `pip install ringserve` brings, and the
system C++ compiler) with `-O3 -march=native`, so the code uses the vector units of the machine
that runs it, and `-fopenmp`: ATen's `parallel_for` is a header template whose OpenMP pragma is
compiled into the extension itself, so without the flag every kernel ran on one thread whatever
`cpu_threads` said (the process has one OpenMP runtime, torch's `libgomp.so.1`, which the
extension's own link resolves to). The extension's name holds a hash of the sources (and their
directory), the flags, torch's version and the CPU's model and feature flags, so a changed source,
another checkout or another CPU builds its own copy in torch's extension cache
(`TORCH_EXTENSIONS_DIR`, default `~/.cache/torch_extensions`); torch locks the build directory, so
processes starting together build it once. First build: 10-50 s; later loads: well under a second. The GPU process builds it while
loading the model, before it reports READY, never inside a step.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch

log = logging.getLogger("ringserve.gpu")

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("cpu_attention.cpp", "cpu_fused.cpp", "cpu_sampling.cpp", "cpu_block.cpp", "cpu_quant.cpp")
HEADERS = ("cpu_common.h", "cpu_kernels.h")
CFLAGS = ("-O3", "-march=native", "-mprefer-vector-width=512", "-Wno-psabi", "-fopenmp")
_OPS = (
    "paged_attention",
    "write_kv",
    "rms_norm",
    "add_rms_norm",
    "rope",
    "silu_mul",
    "argmax_rows",
    "block",
    "qlinear",
    "parallel_width",
)
_PROGRESS_S = 0.5


class CpuOpsUnavailable(RuntimeError):
    """The CPU kernels cannot be built or loaded here; the message says why."""


def ops_loaded() -> bool:
    """True once this process has the kernels registered as `torch.ops.ringserve_cpu.*`."""
    try:
        return all(hasattr(torch.ops.ringserve_cpu, name) for name in _OPS)
    except (AttributeError, RuntimeError):
        return False


def _cpuinfo(keys: tuple[str, ...]) -> list[str] | None:
    """The distinct `/proc/cpuinfo` lines starting with one of `keys`, sorted (None: no such file)."""
    try:
        with open("/proc/cpuinfo") as f:
            return sorted({ln for ln in f.read().splitlines() if ln.startswith(keys)})
    except OSError:
        return None


def _cpu_identity() -> str:
    lines = _cpuinfo(("model name", "flags"))
    if lines is None:
        import platform

        return platform.processor() or platform.machine()
    return "\n".join(lines)


def cpu_bf16_dot() -> bool:
    """True where this CPU has AVX512-BF16 and AVX512-BW: the kernels, built for the machine they
    run on (`-march=native`), then read a bfloat16 KV cache with `vdpbf16ps` instead of widening it."""
    flags = {f for ln in _cpuinfo(("flags",)) or [] for f in ln.split(":", 1)[1].split()}
    return {"avx512_bf16", "avx512bw"} <= flags


def extension_name() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode() + b"\0" + (CSRC / name).read_bytes())
    # The source directory too: ninja rebuilds when a build's command lines change, so two
    # checkouts sharing one build directory would rebuild each other's copy on every load.
    h.update(" ".join(CFLAGS).encode() + torch.__version__.encode() + _cpu_identity().encode() + str(CSRC).encode())
    return f"ringserve_cpu_{h.hexdigest()[:16]}"


def _ensure_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a virtual environment's own ninja is not on it unless activated."""
    if shutil.which("ninja"):
        return
    candidates = [os.path.dirname(sys.executable)]
    try:
        import ninja

        candidates.insert(0, ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    for d in candidates:
        if os.path.isfile(os.path.join(d, "ninja")):
            os.environ["PATH"] = d + os.pathsep + os.environ.get("PATH", "")
            return
    raise CpuOpsUnavailable("ninja is not installed (pip install ninja; ringserve's own install brings it)")


def _build() -> None:
    from torch.utils.cpp_extension import load

    if not (shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")):
        raise CpuOpsUnavailable("no C++ compiler found (install g++, or set CXX)")
    _ensure_ninja_on_path()
    load(
        name=extension_name(),
        sources=[str(CSRC / s) for s in SOURCES],
        extra_cflags=list(CFLAGS),
        extra_ldflags=["-fopenmp"],
        is_python_module=False,
        verbose=False,
    )


def load_cpu_ops(progress: Callable[[], None] | None = None) -> None:
    """Build (first time on this machine) and load the kernels; raises CpuOpsUnavailable.

    `progress` is called about twice a second while a build runs, so a caller with a heartbeat
    (the GPU process while it loads) stays alive through it.
    """
    if ops_loaded():
        return
    failure: list[BaseException] = []

    def build() -> None:
        try:
            _build()
        except BaseException as exc:  # handed to the caller's thread below
            failure.append(exc)

    worker = threading.Thread(target=build, name="ringserve-cpu-ops-build", daemon=True)
    worker.start()
    while worker.is_alive():
        worker.join(_PROGRESS_S)
        if progress is not None:
            progress()
    if failure:
        exc = failure[0]
        if isinstance(exc, CpuOpsUnavailable):
            raise exc
        raise CpuOpsUnavailable(f"building the CPU kernels failed: {exc}") from exc
    if not ops_loaded():
        raise CpuOpsUnavailable("the CPU kernel library loaded but did not register its operators")


def main() -> int:
    """`python -m ringserve.gpu_proc.cpu_ext`: build (or find) the kernels now, as `make install` does."""
    import time

    t0 = time.monotonic()
    try:
        load_cpu_ops()
    except CpuOpsUnavailable as exc:
        print(f"ringserve: CPU kernels unavailable: {exc}", file=sys.stderr)
        return 1
    print(f"ringserve: CPU kernels {extension_name()} ready in {time.monotonic() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
