"""CPU CI for the CUDA kernels: every kernel compiles for sm_80 and sm_90 from the exact source and
options the backend hands NVRTC, and the backend imports without CUDA or CuPy.

`nvcc -ptx` runs when nvcc is on PATH (or at /usr/local/cuda/bin); where an NVRTC library can be
loaded too (the `nvidia-cuda-nvrtc-cu12` wheel torch's CUDA builds depend on, or a system CUDA),
the source also goes through NVRTC itself, the compiler that runs in production, with every entry
point added as a name expression as CuPy adds them. The kernels are templates: `nvcc` instantiates
them through a host-side table of their addresses appended to the source.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ringserve.gpu_proc.attention import cupy_backend
from ringserve.tools.kernel_resources import instantiated_source

ARCHS = ("sm_80", "sm_90")
# CuPy appends these to every NVRTC compile (cupy/cuda/compiler.py), so the checks do too.
CUPY_ADDED_OPTIONS = ("-ftz=true",)


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/nvcc",):
        if os.access(candidate, os.X_OK):
            return candidate
    return None


def _nvrtc() -> ctypes.CDLL | None:
    candidates = []
    try:
        import nvidia.cuda_nvrtc as pkg  # the pip wheel torch's CUDA builds pull in

        lib_dir = Path(list(pkg.__path__)[0]) / "lib"
        candidates += sorted(str(p) for p in lib_dir.glob("libnvrtc.so*") if "alt" not in p.name)
    except ImportError:
        pass
    found = ctypes.util.find_library("nvrtc")
    if found:
        candidates.append(found)
    for path in candidates:
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _ptx_entries(ptx: str) -> list[str]:
    return [line.split()[-1].split("(")[0] for line in ptx.splitlines() if ".entry" in line]


def _demangled(names: list[str]) -> list[str]:
    """Entry names as C++ (`void rs_paged_decode<RsF16, 32, 4>(...)`), via c++filt."""
    proc = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, timeout=60)
    return proc.stdout.splitlines()


def _missing(entries: list[str]) -> list[str]:
    """Entry points of the backend with no kernel among the PTX entries."""
    text = "\n".join(_demangled(entries)).replace(" ", "")
    return [n for n in cupy_backend.entry_points() if n.replace(" ", "") + "(" not in text]


def test_every_kernel_file_is_compiled():
    """Each .cu under kernels/ is part of the source the backend compiles, so none goes untested."""
    on_disk = {p.name for p in cupy_backend.KERNEL_DIR.glob("*.cu")}
    assert on_disk == {cupy_backend.PRELUDE_FILE, *cupy_backend.KERNEL_FILES}


@pytest.mark.parametrize("arch", ARCHS)
def test_nvcc_ptx_compiles_every_entry_point(arch, tmp_path):
    """`nvcc -ptx` accepts the backend's NVRTC source for the arch and emits every entry point."""
    nvcc = _nvcc()
    if nvcc is None:
        pytest.skip("nvcc not found on PATH: kernel compile check skipped (install the CUDA toolkit)")
    src = tmp_path / "ringserve_attention.cu"
    src.write_text(instantiated_source())
    out = tmp_path / f"ringserve_attention_{arch}.ptx"
    cmd = [
        nvcc,
        "-ptx",
        f"-arch={arch}",
        *cupy_backend.NVRTC_OPTIONS,
        *CUPY_ADDED_OPTIONS,
        "-Werror",
        "all-warnings",
        "-o",
        str(out),
        str(src),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    entries = _ptx_entries(out.read_text())
    assert len(entries) == len(cupy_backend.entry_points())
    assert not _missing(entries), f"entry points missing from the PTX: {_missing(entries)}"


@pytest.mark.parametrize("arch", ("compute_80", "compute_90"))
def test_nvrtc_compiles_every_entry_point(arch):
    """NVRTC itself (what CuPy runs on the GPU machine) compiles the source with the backend's options."""
    lib = _nvrtc()
    if lib is None:
        pytest.skip("no NVRTC library loadable (pip install nvidia-cuda-nvrtc-cu12 to run this check)")
    prog = ctypes.c_void_p()
    source = cupy_backend.kernel_source().encode()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source, b"ringserve_attention.cu", 0, None, None) == 0
    try:
        for name in cupy_backend.entry_points():
            assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
        options = [o.encode() for o in (*cupy_backend.NVRTC_OPTIONS, *CUPY_ADDED_OPTIONS, f"-arch={arch}")]
        rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, log.value.decode(errors="replace")
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
    entries = _ptx_entries(ptx.value.decode())
    assert not _missing(entries), f"entry points missing from the PTX: {_missing(entries)}"


def test_backend_imports_without_cupy_or_cuda():
    """Importing the backend pulls in neither CuPy nor a CUDA context (CPU hosts import it freely)."""
    code = (
        "import sys, torch\n"
        "import ringserve.gpu_proc.attention.cupy_backend as b\n"
        "assert 'cupy' not in sys.modules, 'cupy imported at module import'\n"
        "assert not torch.cuda.is_initialized(), 'CUDA initialised at module import'\n"
        "assert b.entry_points()\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
