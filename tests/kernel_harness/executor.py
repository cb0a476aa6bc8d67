"""`HarnessExecutor`: the CPU execution harness as a `KernelExecutor` for the backend's launchers.

`AttentionKernels(HarnessExecutor(...))` runs the launchers exactly as on a GPU (same planning,
same argument tuples) with CPU tensors. Each launch:

1. checks every argument against the kernel's C++ signature as CuPy would pass it: a tensor or 0
   for a pointer, a Python int as 8 bytes, numpy scalars at their width, a Python float as an
   8-byte double; a width or kind that does not match the parameter is an error;
2. copies each tensor's bytes into a buffer between two inaccessible pages (flush against the page
   after it in forward order, against the page before it in reverse order, either at random in
   random order) and maps it read-only when the parameter points to const;
3. runs the grid on the harness runtime, then copies the non-const buffers back.

A tensor over DIRECT_BYTES (a production-sized KV pool) is passed by its own address instead.

Errors (a fault with the buffer and offset named, a barrier or shuffle violation, a deadlock, a
bad argument) raise `KernelFault` with source lines mapped to `file.cu:line`.
"""

from __future__ import annotations

import ctypes
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy
import torch

from ringserve.gpu_proc.attention import cupy_backend

from .build import Build, build

ORDERS = {"forward": 0, "reverse": 1, "random": 2}
DIRECT_BYTES = 1 << 32  # tensors above this are passed without a guarded copy (see _buffer)
_KINDS = {0: "pointer", 1: "integer", 2: "float"}


class KernelFault(AssertionError):
    """A kernel did something the harness forbids, or a launcher passed a wrong argument."""


@dataclass(frozen=True)
class Param:
    name: str
    size: int
    kind: int  # 0 pointer, 1 integer, 2 float
    is_const: bool


class HarnessModule:
    """A built kernel library, loaded: its entry points with their parameter lists."""

    def __init__(self, built: Build, files: Sequence[tuple[str, str]] = ()) -> None:
        self.source = built.source
        self.files = list(files)  # (name, text) parts of the source, for file:line messages
        self.lib = ctypes.CDLL(str(built.library))
        lib = self.lib
        lib.rs_kernel_name.restype = ctypes.c_char_p
        lib.rs_buffer_new.restype = ctypes.c_void_p
        lib.rs_buffer_new.argtypes = [ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_char_p]
        lib.rs_buffer_set_readonly.argtypes = [ctypes.c_void_p]
        lib.rs_buffer_free.argtypes = [ctypes.c_void_p]
        lib.rs_launch.argtypes = [
            ctypes.c_int,
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_uint),
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_int,
            ctypes.c_uint64,
            ctypes.c_char_p,
            ctypes.c_size_t,
        ]
        self.kernels: dict[str, tuple[int, list[Param]]] = {}
        for k in range(lib.rs_kernel_count()):
            name = lib.rs_kernel_name(k).decode()
            names = _param_names(self.source, name)
            params = []
            for p in range(lib.rs_kernel_nparams(k)):
                size, kind, const = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
                lib.rs_kernel_param(k, p, ctypes.byref(size), ctypes.byref(kind), ctypes.byref(const))
                pname = names[p] if p < len(names) else f"#{p}"
                params.append(Param(pname, size.value, kind.value, bool(const.value)))
            self.kernels[name] = (k, params)

    def where(self, text: str) -> str:
        """Rewrite "line N" (of the concatenated source) as "file.cu:M" when the parts are known."""
        if not self.files:
            return text
        starts, line = [], 1
        for name, part in self.files:
            starts.append((line, name))
            line += part.count("\n") + 1

        def repl(m: re.Match) -> str:
            n = int(m.group(1))
            first, name = max((s for s in starts if s[0] <= n), default=(1, "source"))
            return f"{name}:{n - first + 1}"

        return re.sub(r"line (\d+)", repl, text)


def _param_names(source: str, name: str) -> list[str]:
    """Parameter names of kernel `name` (template arguments dropped) from its definition."""
    base = name.split("<")[0]
    m = re.search(r"__global__\s+void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?" + re.escape(base) + r"\s*\(", source)
    if m is None:
        return []
    depth, i = 1, m.end()
    while depth:
        depth += {"(": 1, ")": -1}.get(source[i], 0)
        i += 1
    params = re.sub(r"//[^\n]*", "", source[m.end() : i - 1])
    return [re.findall(r"\w+", p)[-1] for p in params.split(",") if p.strip()]


_MODULES: dict[str, HarnessModule] = {}


def load(source: str | Sequence[tuple[str, str]] | None = None, names: Sequence[str] | None = None) -> HarnessModule:
    """The harness build of `source` with entry points `names` (default: every entry point), built
    once per process and source. `source` is a string, or (file name, text) parts joined as
    kernel_source() joins them (default: the backend's own files)."""
    files = cupy_backend.kernel_files() if source is None else [] if isinstance(source, str) else list(source)
    text = source if isinstance(source, str) else "\n".join(part for _, part in files)
    names = list(cupy_backend.entry_points() if names is None else names)
    key = text + "\0" + "\0".join(names)
    if key not in _MODULES:
        _MODULES[key] = HarnessModule(build(text, names), files)
    return _MODULES[key]


def _span_bytes(t: torch.Tensor) -> int:
    """Bytes from the tensor's first element to the end of its last (the memory a kernel may touch)."""
    if t.numel() == 0:
        return 0
    return (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()


def _describe(arg) -> tuple[str, int, int]:
    """(description, width in bytes, kind) of a launch argument as CuPy would pass it."""
    if isinstance(arg, torch.Tensor):
        return f"a {arg.dtype} tensor", 8, 0
    if isinstance(arg, numpy.generic):
        kind = 2 if isinstance(arg, numpy.floating) else 1
        return f"numpy.{type(arg).__name__}", arg.itemsize, kind
    if isinstance(arg, float):
        return "a Python float (passed as a double)", 8, 2
    if isinstance(arg, int):  # bool included: CuPy passes both as int64
        return "a Python int (passed as int64)", 8, 1
    return type(arg).__name__, -1, -1


class HarnessExecutor:
    """Runs launches on the CPU harness: `order` is forward, reverse or random (seeded) for blocks,
    threads and buffer placement. The occupancy answers are fixed numbers (the planner's inputs)."""

    def __init__(
        self,
        module: HarnessModule | None = None,
        order: str = "forward",
        seed: int = 0,
        sm_count: int = 16,
        ctas_per_sm: int = 4,
        capability: tuple[int, int] = (9, 0),
        require_compile: bool = False,
    ) -> None:
        if order not in ORDERS:
            raise ValueError(f"order must be one of {sorted(ORDERS)}, got {order!r}")
        self.module = module or load()
        self.order = order
        self.rng = random.Random(seed)
        self._sm_count, self._ctas_per_sm, self._capability = sm_count, ctas_per_sm, capability
        self.require_compile = require_compile  # a launch of a kernel compile() did not name fails
        self.compiled: set[str] = set()
        self.launches: list[str] = []

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != "cpu":
            raise ValueError(f"the kernel harness runs on CPU tensors, got {getattr(tensor, 'device', tensor)}")
        return tensor.device

    def empty(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        # NaN, so an output element no kernel writes shows up in every comparison.
        return torch.full(shape, float("nan"), dtype=dtype, device=device)

    def compile(self, names: Sequence[str], device: torch.device, progress: Callable[[], None] | None = None) -> None:
        for name in names:
            if name not in self.module.kernels:
                raise KernelFault(f"{name}: no such entry point in the kernel source")
            self.compiled.add(name)
            if progress is not None:
                progress()

    def sm_count(self, device: torch.device) -> int:
        return self._sm_count

    def ctas_per_sm(self, name: str, device: torch.device, threads: int) -> int:
        return self._ctas_per_sm

    def capability(self, device: torch.device) -> tuple[int, int]:
        return self._capability

    def launch(self, name: str, device: torch.device, grid: tuple, block: tuple, args: tuple) -> None:
        if name not in self.module.kernels:
            raise KernelFault(f"{name}: no such entry point in the kernel source")
        if self.require_compile and name not in self.compiled:
            raise KernelFault(f"{name}: launched without having been compiled first")
        index, params = self.module.kernels[name]
        if len(args) != len(params):
            raise KernelFault(f"{name}: {len(args)} arguments for {len(params)} parameters")
        self.launches.append(name)
        lib = self.module.lib
        storage, buffers, copy_back = [], [], []
        try:
            for i, (arg, p) in enumerate(zip(args, params)):
                storage.append(self._marshal(name, i, arg, p, buffers, copy_back))
            ptrs = (ctypes.c_void_p * max(1, len(storage)))(*[ctypes.addressof(s) for s in storage])
            g = (ctypes.c_uint * 3)(*(list(grid) + [1, 1, 1])[:3])
            b = (ctypes.c_uint * 3)(*(list(block) + [1, 1, 1])[:3])
            err = ctypes.create_string_buffer(8192)
            rc = lib.rs_launch(index, g, b, ptrs, ORDERS[self.order], self.rng.getrandbits(64), err, len(err))
            if rc != 0:
                raise KernelFault(self.module.where(err.value.decode(errors="replace")))
            for t, addr, nbytes in copy_back:
                ctypes.memmove(t.data_ptr(), addr, nbytes)
        finally:
            for addr in buffers:
                lib.rs_buffer_free(addr)

    def _marshal(self, name: str, i: int, arg, p: Param, buffers: list, copy_back: list):
        what, width, kind = _describe(arg)
        where = f"{name}: argument {i} (`{p.name}`, a {p.size}-byte {_KINDS[p.kind]}"
        where += ", const)" if p.kind == 0 and p.is_const else ")"
        if p.kind == 0:
            if isinstance(arg, torch.Tensor):
                return ctypes.c_uint64(self._buffer(name, p, arg, buffers, copy_back))
            if arg is None or (type(arg) is int and arg == 0):
                return ctypes.c_uint64(0)
            raise KernelFault(f"{where} got {what}; pass a tensor (or 0 for a null pointer)")
        if width != p.size or kind != p.kind:
            raise KernelFault(f"{where} got {what}, {width} bytes: the kernel would read the wrong bytes")
        ctype = {
            (1, 4): ctypes.c_int32,
            (1, 8): ctypes.c_int64,
            (2, 4): ctypes.c_float,
            (2, 8): ctypes.c_double,
            (1, 2): ctypes.c_int16,
            (1, 1): ctypes.c_int8,
        }[(p.kind, p.size)]
        return ctype(arg.item() if isinstance(arg, numpy.generic) else arg)

    def _buffer(self, name: str, p: Param, t: torch.Tensor, buffers: list, copy_back: list) -> int:
        if t.device.type != "cpu":
            raise KernelFault(f"{name}: `{p.name}` is on {t.device}; the harness runs on CPU tensors")
        nbytes = _span_bytes(t)
        if nbytes > DIRECT_BYTES:
            # NOTE: a pool of production size (tests map it sparse, MAP_NORESERVE) is passed as it is:
            # a guarded copy would touch every page. Its accesses are checked by the comparison.
            return t.data_ptr()
        at_end = {"forward": 1, "reverse": 0}.get(self.order, self.rng.getrandbits(1))
        lib = self.module.lib
        addr = lib.rs_buffer_new(nbytes, t.data_ptr() % 16, at_end, p.name.encode())
        if not addr:
            raise KernelFault(f"{name}: could not map a guarded buffer of {nbytes} bytes")
        buffers.append(addr)
        if nbytes:
            ctypes.memmove(addr, t.data_ptr(), nbytes)
        if p.is_const:
            lib.rs_buffer_set_readonly(addr)
        else:
            copy_back.append((t, addr, nbytes))
        return addr
