"""`ringserve kernel-resources [--arch sm_90] [--json]`: what each attention kernel costs the SM.

Compiles the exact kernel source (every entry point instantiated) with NVRTC, the compiler CuPy runs
on the device (from the `nvidia-cuda-nvrtc` wheel; `--compiler nvcc` for `nvcc -cubin`; register
counts differ between the two), with ptxas' `-v` report, and reports per kernel: registers, spill stores/loads, static shared memory, resident CTAs per SM
and occupancy (the occupancy calculator's arithmetic, `cupy_executor.resident_ctas`, at the
backend's block size), and, when `cuobjdump` (with `nvdisasm`) is on PATH, the count of tensor-core
(HMMA) and global-load (LDG) instructions in the SASS. Needs NVRTC or nvcc, not a GPU.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from ringserve.gpu_proc.attention import cupy_backend
from ringserve.gpu_proc.attention.cupy_executor import NVRTC_OPTIONS, SmLimits, resident_ctas
from ringserve.tools.commands.nvrtc import CUPY_ADDED_OPTIONS


@dataclass
class KernelResources:
    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    shared_bytes: int
    threads: int
    ctas_per_sm: int
    occupancy_pct: float
    hmma: int | None = None
    ldg: int | None = None


def instantiated_source() -> str:
    """kernel_source() plus a host-side table of every entry point's address: nvcc instantiates
    each template it names, as NVRTC does for a name expression."""
    table = ",\n".join(f"    (void*)&{name}" for name in cupy_backend.entry_points())
    return (
        cupy_backend.kernel_source() + "\nextern void* const rs_instances[];\n"
        f"void* const rs_instances[] = {{\n{table}\n}};\n"
    )


def nvcc_path() -> str | None:
    found = shutil.which("nvcc")
    return found or next((p for p in ("/usr/local/cuda/bin/nvcc",) if Path(p).exists()), None)


def _demangle(names: list[str]) -> dict[str, str]:
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return {m: re.sub(r"^void |\(.*$", "", d).replace("  ", " ") for m, d in zip(names, out)}


def _threads(name: str) -> int:
    """The block size the launchers use for this kernel."""
    if name.startswith("rs_decode_merge"):
        head_dim = re.search(r", (\d+)>", name)
        if head_dim is None:
            raise ValueError(f"{name}: no head dimension in the kernel name")
        return int(head_dim.group(1))  # one thread per channel
    if name.startswith("rs_kv_append"):
        return 256
    if name.startswith("rs_qgemv"):
        return cupy_backend.QGEMV_THREADS
    if name.startswith("rs_qdequant"):
        return cupy_backend.QDEQUANT_THREADS
    return cupy_backend.DECODE_THREADS if name.startswith("rs_paged_decode") else cupy_backend.PREFILL_THREADS


def _sass_counts(cubin: Path) -> dict[str, tuple[int, int]]:
    """mangled name -> (HMMA, LDG) instruction counts, from cuobjdump -sass."""
    if shutil.which("cuobjdump") is None:
        return {}
    proc = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True)
    counts: dict[str, list[int]] = {}
    current = None
    for line in proc.stdout.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            current = counts.setdefault(m.group(1), [0, 0])
        elif current is not None:
            current[0] += " HMMA" in line
            current[1] += " LDG" in line
    return {k: (v[0], v[1]) for k, v in counts.items()}


SM_LIMITS = {"sm_80": SmLimits(shared_bytes=167936), "sm_90": SmLimits()}  # 164 KiB / 228 KiB per SM


def _ptxas_rows(log: str) -> dict[str, dict]:
    """mangled name -> registers, spills and static shared memory, from ptxas' `-v` report."""
    rows: dict[str, dict] = {}
    current = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\S+)'", line)
        if m:
            current = rows.setdefault(m.group(1), {"spill_stores": 0, "spill_loads": 0, "shared_bytes": 0})
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            current["spill_stores"], current["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            current["registers"] = int(m.group(1))
            sm = re.search(r"(\d+) bytes smem", line)
            current["shared_bytes"] = int(sm.group(1)) if sm else 0
    return rows


def _compile_nvcc(arch: str, tmp: Path) -> tuple[str, Path]:
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("neither NVRTC (pip install nvidia-cuda-nvrtc) nor nvcc found")
    src = tmp / "attention.cu"
    src.write_text(instantiated_source())
    cubin = tmp / "attention.cubin"
    cmd = [nvcc, "-cubin", f"-arch={arch}", *NVRTC_OPTIONS, *CUPY_ADDED_OPTIONS, "-Xptxas", "-v", "-o", str(cubin)]
    proc = subprocess.run([*cmd, str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(proc.stderr)
    return proc.stderr, cubin


def _compile_nvrtc(arch: str, tmp: Path) -> tuple[str, Path] | None:
    from ringserve.tools.commands import nvrtc

    lib = nvrtc.load()
    if lib is None:
        return None
    options = (*NVRTC_OPTIONS, *CUPY_ADDED_OPTIONS, f"-arch={arch}", "-Xptxas=-v")
    out = nvrtc.compile_source(lib, cupy_backend.kernel_source(), cupy_backend.entry_points(), options)
    if not out.ok:
        raise RuntimeError(out.log)
    cubin = tmp / "attention.cubin"
    cubin.write_bytes(out.cubin)
    return out.log, cubin


def measure(arch: str = "sm_90", compiler: str = "auto") -> list[KernelResources]:
    """Every entry point's resources on `arch`, compiled by NVRTC (the compiler CuPy runs on the
    device: `auto` takes it when loadable) or nvcc. Register counts differ between the two."""
    if compiler not in ("auto", "nvrtc", "nvcc"):
        raise ValueError(f"compiler must be auto, nvrtc or nvcc, got {compiler!r}")
    with tempfile.TemporaryDirectory() as tmp:
        built = _compile_nvrtc(arch, Path(tmp)) if compiler != "nvcc" else None
        if built is None and compiler == "nvrtc":
            raise RuntimeError("no NVRTC library loadable (pip install nvidia-cuda-nvrtc)")
        log, cubin = built or _compile_nvcc(arch, Path(tmp))
        sass = _sass_counts(cubin)
    rows = _ptxas_rows(log)
    names = _demangle(list(rows))
    limits = SM_LIMITS.get(arch, SmLimits())
    out = []
    for mangled, r in rows.items():
        name = names[mangled]
        threads = _threads(name)
        ctas = resident_ctas(r["registers"], r["shared_bytes"], threads, limits)
        hmma, ldg = sass.get(mangled, (None, None))
        out.append(
            KernelResources(
                name,
                r["registers"],
                r["spill_stores"],
                r["spill_loads"],
                r["shared_bytes"],
                threads,
                ctas,
                round(100 * ctas * -(-threads // 32) / 64, 1),
                hmma,
                ldg,
            )
        )
    return sorted(out, key=lambda k: k.name)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ringserve kernel-resources", description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--compiler", default="auto", choices=("auto", "nvrtc", "nvcc"), help="auto: NVRTC if loadable")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        rows = measure(args.arch, args.compiler)
    except RuntimeError as e:
        print(f"ringserve kernel-resources: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(r) for r in rows]))
        return 0
    print(
        f"{'kernel':<40} {'regs':>4} {'spill':>9} {'smem':>6} {'thr':>4} {'CTA/SM':>6} {'occ%':>5} {'HMMA':>5} {'LDG':>4}"
    )
    for r in rows:
        spill = f"{r.spill_stores}/{r.spill_loads}"
        print(
            f"{r.name:<40} {r.registers:>4} {spill:>9} {r.shared_bytes:>6} {r.threads:>4} {r.ctas_per_sm:>6} "
            f"{r.occupancy_pct:>5} {'-' if r.hmma is None else r.hmma:>5} {'-' if r.ldg is None else r.ldg:>4}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
