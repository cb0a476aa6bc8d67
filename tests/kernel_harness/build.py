"""Compile the exact kernel source as C++ for the CPU execution harness.

The translation unit is `kernel_source()` byte for byte, with one rewrite: each inline `asm`
statement (which has no host meaning) becomes a call to the emulation of its PTX instruction in
`cuda_emulation.h`, its operands wrapped in checks of their constraint types. Only single
instructions the harness knows are accepted; anything else fails the build naming the line. Line
numbers are kept, so harness messages point at the real source. `cuda_emulation.h` is force-included
ahead of it, and a registry of the entry points is appended after it.

Builds are cached under `build/kernel_harness/` by a hash of everything that goes into them.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE_DIR = HERE.parents[1] / "build" / "kernel_harness"
CXX = os.environ.get("CXX", "g++")
# NOTE: -fno-gnu-unique and -Bsymbolic keep every build's symbols its own: the `__shared__`
# statics of template kernels would otherwise be STB_GNU_UNIQUE, one copy per process, and a second
# build (a planted bug) would run on the first build's shared arrays.
CXXFLAGS = (
    "-std=c++17",
    "-O1",
    "-fPIC",
    "-g0",
    "-Wall",
    "-Wno-unknown-pragmas",
    "-Wno-unused-function",
    "-Wno-unused-variable",
    "-Wno-unused-but-set-variable",
    "-fno-strict-aliasing",
    "-fno-gnu-unique",
)
# Every function-local static of the kernel unit (what `__shared__` becomes) lands in a
# `.bss._ZZ*` section (-fdata-sections); the script gathers them into one window with bounds.
LINKER_SCRIPT = """SECTIONS {
  .rs_shared (NOLOAD) : ALIGN(4096) { __rs_shared_start = .; *(.bss._ZZ*) . = ALIGN(16); __rs_shared_stop = .; }
} INSERT AFTER .bss;
"""
# PTX instructions the harness emulates (cuda_emulation.h defines rs_ptx_<opcode, dots as _>).
SUPPORTED_PTX = frozenset(
    {
        "cvt.f32.f16",
        "cvt.rn.f16.f32",
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32",
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32",
        "ldmatrix.sync.aligned.m8n8.x4.shared.b16",
        "ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16",
    }
)


class HarnessBuildError(RuntimeError):
    """The kernel source cannot be compiled for the harness; the message says where and why."""


@dataclass(frozen=True)
class Build:
    library: Path
    source: str  # the kernel source it was built from (for line lookups)


# ---- inline asm -> emulation calls ------------------------------------------------------------


def _skip_string(src: str, i: int) -> int:
    """Index after the string or char literal starting at src[i]."""
    quote = src[i]
    i += 1
    while src[i] != quote:
        i += 2 if src[i] == "\\" else 1
    return i + 1


def _matching_paren(src: str, i: int) -> int:
    """Index of the `)` closing the `(` at src[i]."""
    depth = 0
    while True:
        c = src[i]
        if c in "\"'":
            i = _skip_string(src, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return i
        i += 1


def _split_top(text: str, sep: str) -> list[str]:
    """Split at `sep` outside parentheses and string literals."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c in "\"'":
            i = _skip_string(text, i)
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif c == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
        i += 1
    parts.append(text[start:])
    return parts


_OPERAND = re.compile(r'^\s*"([=+&]*)([a-z])"\s*\((.*)\)\s*$', re.S)


def _translate_one(body: str, line: int) -> str:
    sections = _split_top(body, ":")
    template = "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', sections[0]))
    outputs = [s for s in _split_top(sections[1], ",") if s.strip()] if len(sections) > 1 else []
    inputs = [s for s in _split_top(sections[2], ",") if s.strip()] if len(sections) > 2 else []
    instr = template.strip().rstrip(";").strip()
    if ";" in instr or "\n" in instr:
        raise HarnessBuildError(f"line {line}: the harness emulates single-instruction asm only, got {template!r}")
    opcode = instr.split()[0] if instr else ""
    if opcode not in SUPPORTED_PTX:
        raise HarnessBuildError(
            f"line {line}: no harness emulation for PTX `{opcode}`; add one to "
            f"tests/kernel_harness/cuda_emulation.h and SUPPORTED_PTX"
        )
    refs = [int(n) for n in re.findall(r"%(\d+)", instr)]
    operands = outputs + inputs
    if refs != list(range(len(operands))):
        raise HarnessBuildError(
            f"line {line}: operands must be referenced once each in order %0..%{len(operands) - 1}, got {instr!r}"
        )
    args = []
    for n, text in enumerate(operands):
        m = _OPERAND.match(text)
        if m is None:
            raise HarnessBuildError(f"line {line}: cannot parse asm operand {text.strip()!r}")
        modifiers, letter, expr = m.groups()
        is_out = n < len(outputs)
        if is_out != ("=" in modifiers or "+" in modifiers):
            raise HarnessBuildError(f"line {line}: operand {text.strip()!r} in the wrong list")
        args.append(f"::rs::ptx::{'out' if is_out else 'in'}_{letter}({expr})")
    return f"rs_ptx_{opcode.replace('.', '_')}({', '.join(args)})"


def translate_asm(src: str) -> str:
    """Replace every inline asm statement by its emulation call, keeping line numbers."""
    out, i, n = [], 0, len(src)
    while i < n:
        c = src[i]
        if src.startswith("//", i):
            j = src.find("\n", i)
            j = n if j < 0 else j
            out.append(src[i:j])
            i = j
            continue
        if src.startswith("/*", i):
            j = src.index("*/", i) + 2
            out.append(src[i:j])
            i = j
            continue
        if c in "\"'":
            j = _skip_string(src, i)
            out.append(src[i:j])
            i = j
            continue
        m = re.compile(r"\basm\b(\s+volatile\b)?\s*\(").match(src, i)
        if m and (i == 0 or not (src[i - 1].isalnum() or src[i - 1] == "_")):
            open_paren = m.end() - 1
            close = _matching_paren(src, open_paren)
            line = src.count("\n", 0, i) + 1
            call = _translate_one(src[open_paren + 1 : close], line)
            newlines = src.count("\n", i, close + 1)
            out.append(call + "\n" * newlines)
            i = close + 1
            continue
        out.append(c)
        i += 1
    return "".join(out)


# ---- the entry-point registry -----------------------------------------------------------------

_GLUE_HEAD = """
// ---- appended by tests/kernel_harness/build.py: the entry points, for the harness launcher ----
#include <utility>
namespace rs_glue {
template <class T> constexpr rs::ParamInfo info() {
    return std::is_pointer<T>::value
        ? rs::ParamInfo{8, rs::kPointer, std::is_const<typename std::remove_pointer<T>::type>::value}
        : rs::ParamInfo{(int)sizeof(T), std::is_floating_point<T>::value ? rs::kFloat : rs::kInteger, 0};
}
template <class... A> const rs::ParamInfo params[] = {info<A>()..., rs::ParamInfo{0, 0, 0}};
template <class... A, std::size_t... I>
void call(void (*fn)(), void* const* p, std::index_sequence<I...>) {
    reinterpret_cast<void (*)(A...)>(fn)(*static_cast<typename std::remove_cv<A>::type*>(p[I])...);
}
template <class... A> void invoke(void (*fn)(), void* const* p) { call<A...>(fn, p, std::index_sequence_for<A...>{}); }
template <class... A> int add(const char* name, void (*fn)(A...)) {
    return rs::register_kernel(name, reinterpret_cast<void (*)()>(fn), &invoke<A...>, (int)sizeof...(A), params<A...>);
}
}  // namespace rs_glue
"""


def glue(names: list[str]) -> str:
    lines = [_GLUE_HEAD]
    for i, name in enumerate(names):
        lines.append(f'static const int rs_registered_{i} = rs_glue::add("{name}", &{name});')
    return "\n".join(lines) + "\n"


# ---- compile ----------------------------------------------------------------------------------


def _run(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise HarnessBuildError(f"{what} failed:\n{' '.join(cmd)}\n{proc.stderr[-6000:]}")


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:20]


RUNTIME_SOURCES = ("runtime.cpp", "guarded_buffers.cpp")


def _harness_files() -> str:
    return "".join((HERE / name).read_text() for name in ("rs_runtime.h", *RUNTIME_SOURCES, "cuda_emulation.h"))


def _atomic_write_dir() -> Path:
    CACHE_DIR.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=CACHE_DIR, prefix="tmp-"))


def _runtime_objects() -> list[Path]:
    key = _digest(_harness_files(), CXX, *CXXFLAGS)
    objs = [CACHE_DIR / f"{Path(name).stem}-{key}.o" for name in RUNTIME_SOURCES]
    for name, obj in zip(RUNTIME_SOURCES, objs):
        if not obj.exists():
            tmp = _atomic_write_dir()
            out = tmp / "runtime.o"
            # NOTE: no -fdata-sections here: the runtime's own statics must stay out of the window.
            _run([CXX, *CXXFLAGS, "-c", str(HERE / name), "-o", str(out)], f"compiling the harness runtime ({name})")
            os.replace(out, obj)
            tmp.rmdir()
    return objs


def build(source: str, names: list[str]) -> Build:
    """Compile `source` (a kernel_source()) with entry points `names` into a shared library."""
    unit = translate_asm(source) + glue(names)
    runtime = _runtime_objects()
    key = _digest(unit, _harness_files(), CXX, *CXXFLAGS)
    lib = CACHE_DIR / f"kernels-{key}.so"
    if not lib.exists():
        tmp = _atomic_write_dir()
        (tmp / "kernels.cpp").write_text(unit)
        (tmp / "shared.ld").write_text(LINKER_SCRIPT)
        out = tmp / "kernels.so"
        _run(
            [
                CXX,
                *CXXFLAGS,
                "-fdata-sections",
                "-shared",
                "-I",
                str(HERE),
                "-include",
                "cuda_emulation.h",
                str(tmp / "kernels.cpp"),
                *map(str, runtime),
                "-Wl,-Bsymbolic",
                "-Wl,-T," + str(tmp / "shared.ld"),
                "-o",
                str(out),
            ],
            "compiling the kernel source for the harness",
        )
        os.replace(out, lib)
        for f in tmp.iterdir():
            f.unlink()
        tmp.rmdir()
    return Build(lib, source)
