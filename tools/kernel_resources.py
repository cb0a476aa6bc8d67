"""`ringserve kernel-resources [--arch sm_90] [--json]`: what each attention kernel costs the SM.

Compiles the exact kernel source (every entry point instantiated) with `nvcc -cubin -Xptxas -v`
and reports per kernel: registers, spill stores/loads, static shared memory, resident CTAs per SM
and occupancy (the occupancy calculator's arithmetic, `cupy_executor.resident_ctas`, at the
backend's block size), and, when `cuobjdump` (with `nvdisasm`) is on PATH, the count of tensor-core
(HMMA) and global-load (LDG) instructions in the SASS. Needs nvcc, not a GPU.
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
from ringserve.gpu_proc.attention.cupy_executor import NVRTC_OPTIONS, resident_ctas

# CuPy appends this to every NVRTC compile; the resources must be those of what runs.
CUPY_ADDED_OPTIONS = ("-ftz=true",)


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


def measure(arch: str = "sm_90") -> list[KernelResources]:
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (install the CUDA toolkit)")
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "attention.cu"
        src.write_text(instantiated_source())
        cubin = Path(tmp) / "attention.cubin"
        proc = subprocess.run(
            [
                nvcc,
                "-cubin",
                f"-arch={arch}",
                *NVRTC_OPTIONS,
                *CUPY_ADDED_OPTIONS,
                "-Xptxas",
                "-v",
                "-o",
                str(cubin),
                str(src),
            ],
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr)
        sass = _sass_counts(cubin)
    rows: dict[str, dict] = {}
    current = None
    for line in proc.stderr.splitlines():
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
            s = re.search(r"(\d+) bytes smem", line)
            current["shared_bytes"] = int(s.group(1)) if s else 0
    names = _demangle(list(rows))
    out = []
    for mangled, r in rows.items():
        name = names[mangled]
        threads = _threads(name)
        ctas = resident_ctas(r["registers"], r["shared_bytes"], threads)
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
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        rows = measure(args.arch)
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
