"""CPU CI for the CUDA kernels: every kernel compiles for sm_80 and sm_90 from the exact source and
options the backend hands NVRTC, and the backend imports without CUDA or CuPy.

NVRTC, the compiler that runs in production, compiles the source in every run of `make test`: the
test extra installs NVIDIA's `nvidia-cuda-nvrtc` wheel (a host library, no GPU), and the checks
compile as CuPy does on a device (`-arch=sm_80` / `sm_90`, `-ftz=true`, every entry point added as a
name expression) and read ptxas' resource report from that compile: no spills, static shared memory
within sm_80's limits. `nvcc -ptx` runs too where nvcc is on PATH (or at /usr/local/cuda/bin); the
kernels are templates, so `nvcc` instantiates them through a host-side table of their addresses.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from ringserve.gpu_proc.attention import cupy_backend
from ringserve.gpu_proc.attention.cupy_executor import resident_ctas
from ringserve.tools.commands import kernel_resources, nvrtc
from ringserve.tools.commands.kernel_resources import instantiated_source

ARCHS = ("sm_80", "sm_90")
CUPY_ADDED_OPTIONS = nvrtc.CUPY_ADDED_OPTIONS


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for candidate in ("/usr/local/cuda/bin/nvcc",):
        if os.access(candidate, os.X_OK):
            return candidate
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


@pytest.fixture(scope="module", params=ARCHS)
def nvrtc_build(request):
    """The backend's source compiled by NVRTC for one arch exactly as CuPy compiles it on a device of
    that arch (its options, `-arch=sm_XX`, every entry point a name expression), with ptxas' report."""
    lib = nvrtc.load()
    assert lib is not None, "no NVRTC library: the test extra installs nvidia-cuda-nvrtc (make install)"
    arch = request.param
    options = (*cupy_backend.NVRTC_OPTIONS, *nvrtc.CUPY_ADDED_OPTIONS, f"-arch={arch}", "-Xptxas=-v")
    out = nvrtc.compile_source(lib, cupy_backend.kernel_source(), cupy_backend.entry_points(), options)
    assert out.ok, out.log
    return arch, out


def test_nvrtc_compiles_every_entry_point(nvrtc_build):
    """NVRTC (what CuPy runs on the GPU machine) compiles every instantiation to a cubin for the arch."""
    arch, out = nvrtc_build
    assert out.cubin, f"no cubin for {arch}"
    entries = _ptx_entries(out.ptx)
    assert len(entries) == len(cupy_backend.entry_points())
    assert not _missing(entries), f"entry points missing from the PTX: {_missing(entries)}"


# Static shared memory per block is capped at 48 KiB; an sm_80 SM has 164 KiB for its CTAs.
STATIC_SMEM_LIMIT = 48 * 1024


def test_no_kernel_spills_and_shared_memory_fits_sm80(nvrtc_build):
    """ptxas (inside NVRTC, as on the device): no kernel spills registers, none exceeds the static
    shared-memory limit, and every kernel keeps two CTAs resident on an sm_80 SM (164 KiB)."""
    arch, out = nvrtc_build
    rows = kernel_resources._ptxas_rows(out.log)
    assert len(rows) == len(cupy_backend.entry_points())
    names = kernel_resources._demangle(list(rows))
    spills = {
        names[m]: (r["spill_stores"], r["spill_loads"])
        for m, r in rows.items()
        if r["spill_stores"] or r["spill_loads"]
    }
    assert not spills, f"{arch}: kernels spilling (stores, loads bytes): {spills}"
    sm80 = kernel_resources.SM_LIMITS["sm_80"]
    for mangled, r in rows.items():
        name = names[mangled]
        assert r["shared_bytes"] <= STATIC_SMEM_LIMIT, f"{name}: {r['shared_bytes']} bytes of static shared memory"
        ctas = resident_ctas(r["registers"], r["shared_bytes"], kernel_resources._threads(name), sm80)
        assert ctas >= 2, f"{name} ({arch}): {r['registers']} registers, {r['shared_bytes']} B shared: {ctas} CTA/SM"


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
