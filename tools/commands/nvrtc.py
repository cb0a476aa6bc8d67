"""NVRTC without a GPU: the compiler CuPy runs on the device, loaded from NVIDIA's pip wheel.

CuPy compiles the attention kernels with NVRTC at the server's start; NVRTC is a host library that
needs no GPU, and NVIDIA ships it as a wheel (`nvidia-cuda-nvrtc`, CUDA 13: `nvidia/cu13/lib`;
`nvidia-cuda-nvrtc-cu12`: `nvidia/cuda_nvrtc/lib`), which the test extra installs. So CI compiles
the exact source, with CuPy's options, as the device will, and reads ptxas' resource report
(`-Xptxas=-v`: registers, spills, shared memory) from the same compile. The library is loaded with
ctypes; its builtins library is loaded first, globally, as NVRTC looks it up by name.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

# CuPy appends these to every NVRTC compile (cupy/cuda/compiler.py) and passes `-arch=sm_XX` for a
# device NVRTC knows (it then loads the cubin, no driver JIT), so these checks do too.
CUPY_ADDED_OPTIONS = ("-ftz=true",)


@dataclass(frozen=True)
class Nvrtc:
    lib: ctypes.CDLL
    path: str
    version: tuple[int, int]


@dataclass(frozen=True)
class Compiled:
    ok: bool
    log: str
    ptx: str
    cubin: bytes


def _wheel_libraries() -> list[Path]:
    """libnvrtc.so.<major> inside NVIDIA's wheels, newest CUDA first."""
    spec = importlib.util.find_spec("nvidia")
    if spec is None or not spec.submodule_search_locations:
        return []
    found = []
    for root in spec.submodule_search_locations:
        found += [p for p in Path(root).glob("*/lib/libnvrtc.so.*") if ".alt." not in p.name]
    return sorted(found, key=lambda p: p.name, reverse=True)


def load() -> Nvrtc | None:
    """The newest NVRTC loadable here (a wheel's, else the system's), or None."""
    candidates = [str(p) for p in _wheel_libraries()]
    system = ctypes.util.find_library("nvrtc")
    if system:
        candidates.append(system)
    for path in candidates:
        for builtins in sorted(Path(path).parent.glob("libnvrtc-builtins.so.*")):
            if ".alt." not in builtins.name:
                try:
                    ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    pass
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        major, minor = ctypes.c_int(), ctypes.c_int()
        if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
            continue
        return Nvrtc(lib, path, (major.value, minor.value))
    return None


def compile_source(nvrtc: Nvrtc, source: str, names: Sequence[str], options: Sequence[str]) -> Compiled:
    """Compile `source` with every name in `names` added as a name expression (as CuPy adds them);
    the cubin is empty for a virtual arch (`-arch=compute_XX`)."""
    lib = nvrtc.lib
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"ringserve_attention.cu", 0, None, None):
        raise RuntimeError("nvrtcCreateProgram failed")
    try:
        for name in names:
            if lib.nvrtcAddNameExpression(prog, name.encode()):
                raise RuntimeError(f"nvrtcAddNameExpression failed for {name}")
        opts = [o.encode() for o in options]
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        if rc:
            return Compiled(False, log.value.decode(errors="replace"), "", b"")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        cubin = b""
        if lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)) == 0 and size.value:
            buf = ctypes.create_string_buffer(size.value)
            lib.nvrtcGetCUBIN(prog, buf)
            cubin = buf.raw
        return Compiled(True, log.value.decode(errors="replace"), ptx.value.decode(errors="replace"), cubin)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
