"""CUDA attention backend: CuPy raw kernels for KV append and paged attention.

Same two functions as `reference.py` (the spec): `write_kv` and `paged_attention`. The kernels in
`kernels/*.cu` are compiled at first use with NVRTC through `cupy.RawModule` (CuPy caches the
binary on disk, and this module caches the loaded functions per device), and launched on torch's
current stream through `cupy.cuda.ExternalStream`, so they order correctly with the torch ops
around them and can be captured in a CUDA graph.

Memory is shared with torch zero-copy by passing each tensor's device address as a kernel
argument. This is the same sharing DLPack gives (`cupy.from_dlpack(t)` wraps the same address),
minus two problems: CuPy has no bfloat16 dtype, so a bf16 tensor cannot cross DLPack, and building
a DLPack capsule and a CuPy array costs microseconds per tensor, hundreds of times per step (8
tensors x 2 calls x 32 layers). Every launcher therefore checks shape, dtype, strides, alignment and
device itself before launching, and raises ValueError / TypeError naming the argument.

Importing this module needs neither CuPy nor CUDA; `import cupy` happens at the first launch.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path

import torch

from .cupy_checks import (  # noqa: F401  (re-exported: the backend's public surface)
    BLOCK_SIZE,
    DTYPE_NAMES,
    HEAD_DIMS,
    check_attention_args,
    check_write_kv_args,
    require_cuda,
)

KERNEL_DIR = Path(__file__).parent / "kernels"
PRELUDE_FILE = "common.cu"  # prepended to every kernel file: NVRTC gets one self-contained source
KERNEL_FILES = ("kv_append.cu", "paged_decode.cu", "paged_prefill.cu")
# Passed to NVRTC as given; the CI test hands the same list to `nvcc -ptx` (CuPy adds -arch).
NVRTC_OPTIONS = ("--std=c++17",)

DECODE_GROUPS = (4, 2, 1)  # query heads per decode CTA (see paged_decode.cu for why not 8)
DECODE_THREADS = 128
PREFILL_ROWS = 32
PREFILL_THREADS = 128
# A split covers at least this many KV blocks (256 tokens): below that, the merge pass and the
# scratch traffic cost more than the parallelism gains.
MIN_BLOCKS_PER_SPLIT = 16
_LOG2E = 1.4426950408889634


def kernel_source() -> str:
    """The exact source NVRTC compiles: the prelude followed by every kernel file."""
    parts = [(KERNEL_DIR / PRELUDE_FILE).read_text()]
    parts += [(KERNEL_DIR / name).read_text() for name in KERNEL_FILES]
    return "\n".join(parts)


def entry_points() -> list[str]:
    """Every `extern "C"` kernel the backend fetches from the compiled module."""
    names = ["rs_kv_append"]
    for dt in DTYPE_NAMES.values():
        for d in HEAD_DIMS:
            names += [f"rs_paged_decode_{dt}_d{d}_g{g}" for g in DECODE_GROUPS]
            names += [f"rs_decode_merge_{dt}_d{d}", f"rs_paged_prefill_{dt}_d{d}"]
    return names


@functools.lru_cache(maxsize=None)
def _kernels(device_index: int) -> dict:
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=kernel_source(), options=NVRTC_OPTIONS)
        return {name: module.get_function(name) for name in entry_points()}


@functools.lru_cache(maxsize=64)
def _external_stream(stream_ptr: int, device_index: int):
    import cupy

    return cupy.cuda.ExternalStream(stream_ptr, device_index)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _launch(name: str, device: torch.device, grid: tuple, block: tuple, args: tuple) -> None:
    import cupy

    index = device.index if device.index is not None else torch.cuda.current_device()
    fn = _kernels(index)[name]
    stream = _external_stream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index), stream:
        fn(grid, block, args)


# ---- write_kv ----------------------------------------------------------------------------------


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values `[T, num_kv_heads, head_dim]` at their flat slots (negative: skip)."""
    device = require_cuda(k_cache)
    check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
    num_blocks, num_kv_heads, _, head_dim = k_cache.shape
    t = k.shape[0]
    if t == 0:
        return
    vec = 16 // k.element_size()  # elements per 16-byte vector
    row_vecs = num_kv_heads * head_dim // vec
    threads = min(256, max(32, (row_vecs + 31) // 32 * 32))
    _launch("rs_kv_append", device, (t,), (threads,), (
        k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slot_mapping.data_ptr(),
        k.stride(0) // vec, v.stride(0) // vec, _i32(num_kv_heads), _i32(head_dim // vec),
        num_blocks * BLOCK_SIZE))


# ---- paged attention ---------------------------------------------------------------------------


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                    scale: float) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys; q `[T, num_heads, head_dim]`.

    A step whose rows all carry one new token runs the decode kernel. A mixed step runs both: the
    decode kernel for its one-token rows and the tiled prefill kernel for its chunks, each skipping
    the other's rows in-kernel (no host sync to split the batch), together writing every row once.
    """
    if meta.max_query_len == 1:
        return paged_decode(q, k_cache, v_cache, meta, scale)
    require_cuda(k_cache)
    device = check_attention_args(q, k_cache, v_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)  # [T, H, D], contiguous
    if q.shape[0]:
        _decode(q, k_cache, v_cache, meta, scale, out, None, single_only=True)
        _prefill(q, k_cache, v_cache, meta, scale, out, skip_single=True)
    return out


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float,
                 *, num_splits: int | None = None) -> torch.Tensor:
    """The decode kernel: one CTA per token and head group, exact for any flat batch (each token
    sees positions 0..its own). Split over the context when the batch is too small to fill the
    GPU; `num_splits` forces the split count (tests and benchmarks)."""
    require_cuda(k_cache)
    device = check_attention_args(q, k_cache, v_cache, meta)
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    out = torch.empty(q.shape, dtype=q.dtype, device=device)  # [T, H, D], contiguous
    if q.shape[0]:
        _decode(q, k_cache, v_cache, meta, scale, out, num_splits)
    return out


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta,
                  scale: float) -> torch.Tensor:
    """The prefill kernel: query tiles of 32 tokens of one sequence, online softmax over the paged
    cache, causal inside the chunk and full over the cached prefix."""
    require_cuda(k_cache)
    device = check_attention_args(q, k_cache, v_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype, device=device)  # [T, H, D], contiguous
    if q.shape[0]:
        _prefill(q, k_cache, v_cache, meta, scale, out)
    return out


def plan_decode_splits(num_ctas: int, max_seq_len: int, sm_count: int) -> int:
    """Number of KV splits: enough CTAs for two waves over the SMs, no split under 16 blocks."""
    max_blocks = max(1, math.ceil(max_seq_len / BLOCK_SIZE))
    if num_ctas >= 2 * sm_count or max_blocks < 2 * MIN_BLOCKS_PER_SPLIT:
        return 1
    want = math.ceil(2 * sm_count / num_ctas)
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))


def _decode(q, k_cache, v_cache, meta, scale, out, num_splits, single_only: bool = False) -> None:
    device = q.device
    t, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    per_kv = num_heads // num_kv_heads
    group = next(g for g in DECODE_GROUPS if per_kv % g == 0)
    chunks = num_heads // group
    if num_splits is None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        num_splits = plan_decode_splits(t * chunks, meta.max_seq_len, _sm_count(index))
    max_blocks = math.ceil(meta.max_seq_len / BLOCK_SIZE)
    blocks_per_split = math.ceil(max_blocks / num_splits)
    num_splits = math.ceil(max_blocks / blocks_per_split)  # drop splits that would all be empty
    dt = DTYPE_NAMES[q.dtype]
    single_qsl = meta.query_start_loc.data_ptr() if single_only else 0  # 0: every token
    part_acc = part_ml = None
    if num_splits > 1:
        part_acc = torch.empty((num_splits, t, num_heads, head_dim), dtype=torch.float32, device=device)
        part_ml = torch.empty((num_splits, t, num_heads, 2), dtype=torch.float32, device=device)
    _launch(f"rs_paged_decode_{dt}_d{head_dim}_g{group}", device, (t, chunks, num_splits),
            (DECODE_THREADS,), (
                q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                meta.block_tables.data_ptr(), _i32(meta.block_tables.shape[1]), meta.positions.data_ptr(),
                meta.token_seq.data_ptr(), _i32(num_heads), _i32(num_kv_heads), _f32(scale * _LOG2E),
                _i32(blocks_per_split), single_qsl, out.data_ptr(),
                0 if part_acc is None else part_acc.data_ptr(),
                0 if part_ml is None else part_ml.data_ptr()))
    if num_splits > 1:
        _launch(f"rs_decode_merge_{dt}_d{head_dim}", device, (t, num_heads), (head_dim,), (
            part_acc.data_ptr(), part_ml.data_ptr(), _i32(num_splits), single_qsl, meta.token_seq.data_ptr(),
            out.data_ptr()))


def _prefill(q, k_cache, v_cache, meta, scale, out, skip_single: bool = False) -> None:
    device = q.device
    t, num_heads, head_dim = q.shape
    s = meta.seq_lens.shape[0]
    # Upper bound on the tile count without reading query_start_loc back (no host sync): every
    # sequence wastes at most one partial tile. Surplus CTAs exit immediately.
    tiles = math.ceil(t / PREFILL_ROWS) + s
    _launch(f"rs_paged_prefill_{DTYPE_NAMES[q.dtype]}_d{head_dim}", device, (tiles, num_heads),
            (PREFILL_THREADS,), (
                q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(),
                meta.block_tables.data_ptr(), _i32(meta.block_tables.shape[1]),
                meta.query_start_loc.data_ptr(), _i32(s), _i32(int(skip_single)), meta.positions.data_ptr(),
                _i32(num_heads),
                _i32(k_cache.shape[1]), _f32(scale * _LOG2E), out.data_ptr()))


def _i32(x: int):
    import numpy

    return numpy.int32(x)


def _f32(x: float):
    import numpy

    return numpy.float32(x)
