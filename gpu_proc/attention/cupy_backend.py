"""CUDA attention backend: the launchers of the raw kernels for KV append and paged attention.

Same two functions as `reference.py` (the spec): `write_kv` and `paged_attention`, as methods of
`AttentionKernels`, which plans each launch (kernel, grid, block, argument list) and hands it to an
executor: `CupyExecutor` on a GPU (NVRTC through CuPy, torch's current stream), or the CPU
execution harness in tests (`tests/kernel_harness`), which runs the same source and checks every
argument's width against the kernel's signature. `default_kernels()` is the GPU instance the
engine uses.

Memory is shared with torch zero-copy: each tensor argument is passed as its device address. This
is the sharing DLPack gives (`cupy.from_dlpack(t)` wraps the same address), minus two problems: CuPy
has no bfloat16 dtype, so a bf16 tensor cannot cross DLPack, and building a DLPack capsule and a
CuPy array costs microseconds per tensor, hundreds of times per step. Every launcher therefore checks
shape, dtype, strides, alignment and device itself before launching, and raises ValueError /
TypeError naming the argument.

The kernels are C++ templates; each instantiation is named by an NVRTC name expression
(`rs_paged_decode<RsF16, 128, 4>`), so a model compiles only the handful it launches
(`model_kernels`), during its load. Importing this module needs neither CuPy nor CUDA.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path

import numpy
import torch

from .cupy_checks import (  # noqa: F401  (re-exported: the backend's public surface)
    BLOCK_SIZE,
    DTYPE_NAMES,
    HEAD_DIMS,
    check_attention_args,
    check_block_tables,
    check_write_kv_args,
    require_cuda,
)
from .cupy_executor import NVRTC_OPTIONS, CupyExecutor, KernelExecutor  # noqa: F401

KERNEL_DIR = Path(__file__).parent / "kernels"
PRELUDE_FILE = "common.cu"  # prepended to every kernel file: NVRTC gets one self-contained source
# quant_linear.cu and lora_sgmv.cu are not attention: the quantized projections and the LoRA deltas
# (launchers in gpu_proc/quant_cuda.py, gpu_proc/lora_cuda.py) share the NVRTC unit, its prelude and
# every check of it (compile, resources, harness).
KERNEL_FILES = (
    "kv_append.cu",
    "paged_decode.cu",
    "paged_prefill.cu",
    "paged_prefill_tc.cu",
    "quant_linear.cu",
    "lora_sgmv.cu",
)
TRAITS = {torch.float16: "RsF16", torch.bfloat16: "RsBF16", torch.float32: "RsF32"}
QUANT_TRAITS = {"Q4_0": "RsQ4_0", "Q4_1": "RsQ4_1", "Q5_0": "RsQ5_0", "Q5_1": "RsQ5_1", "Q8_0": "RsQ8_0"}
QGEMV_THREADS = 128  # 4 warps, one output row each (quant_linear.cu)
QDEQUANT_THREADS = 256
LORA_SHRINK_WARPS = 4  # ranks per shrink CTA, a warp each (lora_sgmv.cu RS_LORA_WARPS)
LORA_EXPAND_COLS = 128  # output columns per expand CTA, a thread each (RS_LORA_COLS)

# Query heads per decode CTA. A group of 8 needs more registers than fit without spilling (see
# paged_decode.cu), so a GQA-8 model runs two CTAs of 4 heads per KV head; 3 serves GQA 3 and 6
# (SmolLM2's 9 / 3 heads) without streaming a KV head once per query head.
DECODE_GROUPS = (4, 3, 2, 1)
DECODE_THREADS = 128
PREFILL_ROWS = 32
PREFILL_THREADS = 128
# Tensor-core prefill: 64 query rows (token, head-of-group pairs) per CTA, on sm_80 and later.
TC_ROWS = 64
TC_THREADS = 128
TC_DTYPES = (torch.float16, torch.bfloat16)
# A split covers at least this many KV blocks (256 tokens): below that, the merge pass and the
# scratch traffic cost more than the parallelism gains.
MIN_BLOCKS_PER_SPLIT = 16
KV_APPEND = "rs_kv_append"
_LOG2E = 1.4426950408889634


def kernel_files() -> list[tuple[str, str]]:
    """(file name, text) of the prelude and every kernel file, in source order."""
    return [(name, (KERNEL_DIR / name).read_text()) for name in (PRELUDE_FILE, *KERNEL_FILES)]


def kernel_source() -> str:
    """The exact source NVRTC compiles: the prelude followed by every kernel file."""
    return "\n".join(text for _, text in kernel_files())


def decode_kernel(dtype: torch.dtype, head_dim: int, group: int) -> str:
    return f"rs_paged_decode<{TRAITS[dtype]}, {head_dim}, {group}>"


def merge_kernel(dtype: torch.dtype, head_dim: int) -> str:
    return f"rs_decode_merge<{TRAITS[dtype]}, {head_dim}>"


def prefill_kernel(dtype: torch.dtype, head_dim: int) -> str:
    return f"rs_paged_prefill<{TRAITS[dtype]}, {head_dim}>"


def prefill_tc_kernel(dtype: torch.dtype, head_dim: int) -> str:
    return f"rs_paged_prefill_tc<{TRAITS[dtype]}, {head_dim}>"


def qgemv_kernel(fmt: str, dtype: torch.dtype) -> str:
    return f"rs_qgemv<{QUANT_TRAITS[fmt]}, {TRAITS[dtype]}>"


def qdequant_kernel(fmt: str, dtype: torch.dtype) -> str:
    return f"rs_qdequant<{QUANT_TRAITS[fmt]}, {TRAITS[dtype]}>"


def lora_shrink_kernel(dtype: torch.dtype) -> str:
    return f"rs_lora_shrink<{TRAITS[dtype]}>"


def lora_expand_kernel(dtype: torch.dtype) -> str:
    return f"rs_lora_expand<{TRAITS[dtype]}>"


def uses_tensor_cores(dtype: torch.dtype, num_heads: int, num_kv_heads: int, capability: tuple[int, int]) -> bool:
    """Prefill runs on tensor cores for fp16/bf16 on sm_80+ when a GQA group fits a tile; fp32 (the
    exact comparison path) and older GPUs use the CUDA-core kernel."""
    return dtype in TC_DTYPES and capability >= (8, 0) and num_heads // num_kv_heads <= TC_ROWS


def decode_group(num_heads: int, num_kv_heads: int) -> int:
    """Query heads per decode CTA: the largest of DECODE_GROUPS dividing the heads per KV head."""
    per_kv = num_heads // num_kv_heads
    return next(g for g in DECODE_GROUPS if per_kv % g == 0)


def op_kernels(
    dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, capability: tuple[int, int]
) -> dict[str, tuple[str, ...]]:
    """The kernels each op of a model with these attention shapes launches on a GPU of
    `capability` (the ops the start-up check verifies one by one, `self_check.py`)."""
    tc = uses_tensor_cores(dtype, num_heads, num_kv_heads, capability)
    return {
        "write_kv": (KV_APPEND,),
        "decode": (
            decode_kernel(dtype, head_dim, decode_group(num_heads, num_kv_heads)),
            merge_kernel(dtype, head_dim),
        ),
        "prefill": ((prefill_tc_kernel if tc else prefill_kernel)(dtype, head_dim),),
    }


def model_kernels(
    dtype: torch.dtype, head_dim: int, num_heads: int, num_kv_heads: int, capability: tuple[int, int]
) -> list[str]:
    """Every kernel a model with these attention shapes launches on a GPU of `capability`."""
    ops = op_kernels(dtype, head_dim, num_heads, num_kv_heads, capability)
    return [name for names in ops.values() for name in names]


def entry_points() -> list[str]:
    """Every kernel instantiation the backend can launch (what the compile checks build)."""
    names = [KV_APPEND]
    for dtype in TRAITS:
        for d in HEAD_DIMS:
            names += [decode_kernel(dtype, d, g) for g in DECODE_GROUPS]
            names += [merge_kernel(dtype, d), prefill_kernel(dtype, d)]
            if dtype in TC_DTYPES:
                names.append(prefill_tc_kernel(dtype, d))
    for dtype in TRAITS:
        for fmt in QUANT_TRAITS:
            names += [qgemv_kernel(fmt, dtype), qdequant_kernel(fmt, dtype)]
        names += [lora_shrink_kernel(dtype), lora_expand_kernel(dtype)]
    return names


def plan_decode_splits(num_ctas: int, max_seq_len: int, sm_count: int, ctas_per_sm: int) -> int:
    """Number of KV splits so the decode work (`num_ctas`: one-token rows x head groups) fills one
    wave of resident CTAs (`sm_count * ctas_per_sm`, from the kernel's real occupancy), never
    cutting a split under 16 blocks. Each row's splits share out its own blocks (in the kernel), so
    a short row under a long `max_seq_len` (a CUDA graph's, planned for the context limit) keeps
    all its splits busy."""
    max_blocks = max(1, math.ceil(max_seq_len / BLOCK_SIZE))
    slots = sm_count * ctas_per_sm
    if num_ctas >= slots or max_blocks < 2 * MIN_BLOCKS_PER_SPLIT:
        return 1
    want = math.ceil(slots / num_ctas)
    return max(1, min(want, max_blocks // MIN_BLOCKS_PER_SPLIT))


class AttentionKernels:
    """The launchers, running their kernels on `executor`."""

    def __init__(self, executor: KernelExecutor) -> None:
        self.executor = executor

    def compile(
        self,
        dtype: torch.dtype,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        device: torch.device,
        progress: Callable[[], None] | None = None,
    ) -> list[str]:
        """Compile every kernel a model of these shapes launches; returns their names."""
        device = torch.device(device)
        names = model_kernels(dtype, head_dim, num_heads, num_kv_heads, self.executor.capability(device))
        self.executor.compile(names, device, progress)
        return names

    # ---- write_kv ------------------------------------------------------------------------------

    def write_kv(
        self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Store new keys/values `[T, num_kv_heads, head_dim]` at their flat slots (negative: skip)."""
        device = self.executor.device_of(k_cache)
        check_write_kv_args(k, v, k_cache, v_cache, slot_mapping)
        num_blocks, num_kv_heads, _, head_dim = k_cache.shape
        t = k.shape[0]
        if t == 0:
            return
        vec = 16 // k.element_size()  # elements per 16-byte vector
        row_vecs = num_kv_heads * head_dim // vec
        threads = min(256, max(32, (row_vecs + 31) // 32 * 32))
        self.executor.launch(
            KV_APPEND,
            device,
            (t,),
            (threads,),
            (
                k,
                v,
                k_cache,
                v_cache,
                slot_mapping,
                k.stride(0) // vec,
                v.stride(0) // vec,
                _i32(num_kv_heads),
                _i32(head_dim // vec),
                num_blocks * BLOCK_SIZE,
            ),
        )

    # ---- paged attention -----------------------------------------------------------------------

    def paged_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float
    ) -> torch.Tensor:
        """Causal attention of each new token over its sequence's cached keys; q `[T, num_heads, head_dim]`.

        A step whose rows all carry one new token runs the decode kernel. A mixed step runs both: the
        decode kernel for its one-token rows and the tiled prefill kernel for its chunks, each skipping
        the other's rows in-kernel (no host sync to split the batch), together writing every row once.
        """
        if meta.max_query_len == 1:
            return self.paged_decode(q, k_cache, v_cache, meta, scale)
        device = self._checked(q, k_cache, v_cache, meta)
        out = self.executor.empty(tuple(q.shape), q.dtype, device)  # [T, H, D], contiguous
        if q.shape[0]:
            self._decode(q, k_cache, v_cache, meta, scale, out, None, single_only=True)
            self._prefill(q, k_cache, v_cache, meta, scale, out, skip_single=True)
        return out

    def paged_decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta,
        scale: float,
        *,
        num_splits: int | None = None,
    ) -> torch.Tensor:
        """The decode kernel: one CTA per token and head group, exact for any flat batch (each token
        sees positions 0..its own). Split over the context when the batch is too small to fill the
        GPU; `num_splits` forces the split count (tests and benchmarks)."""
        device = self._checked(q, k_cache, v_cache, meta)
        if num_splits is not None and num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        out = self.executor.empty(tuple(q.shape), q.dtype, device)  # [T, H, D], contiguous
        if q.shape[0]:
            self._decode(q, k_cache, v_cache, meta, scale, out, num_splits)
        return out

    def paged_prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta, scale: float
    ) -> torch.Tensor:
        """The prefill kernel: query tiles of one sequence, online softmax over the paged cache, causal
        inside the chunk and full over the cached prefix; on tensor cores for fp16/bf16 on sm_80+
        (`uses_tensor_cores`), else on CUDA cores."""
        device = self._checked(q, k_cache, v_cache, meta)
        out = self.executor.empty(tuple(q.shape), q.dtype, device)  # [T, H, D], contiguous
        if q.shape[0]:
            self._prefill(q, k_cache, v_cache, meta, scale, out)
        return out

    def _checked(self, q, k_cache, v_cache, meta) -> torch.device:
        self.executor.device_of(k_cache)
        device = check_attention_args(q, k_cache, v_cache, meta)
        check_block_tables(meta, k_cache.shape[0])
        return device

    def _decode(self, q, k_cache, v_cache, meta, scale, out, num_splits, single_only: bool = False) -> None:
        device = q.device
        t, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        group = decode_group(num_heads, num_kv_heads)
        chunks = num_heads // group
        name = decode_kernel(q.dtype, head_dim, group)
        min_blocks = 1  # forced splits (tests, benchmarks) cut where they are told
        if num_splits is None:
            ex = self.executor
            rows = t if meta.single_rows < 0 else meta.single_rows  # a mixed step's chunk tokens exit at once
            num_splits = plan_decode_splits(
                max(1, rows) * chunks,
                meta.max_seq_len,
                ex.sm_count(device),
                ex.ctas_per_sm(name, device, DECODE_THREADS),
            )
            min_blocks = MIN_BLOCKS_PER_SPLIT
        max_blocks = math.ceil(meta.max_seq_len / BLOCK_SIZE)
        blocks_per_split = math.ceil(max_blocks / num_splits)
        num_splits = math.ceil(max_blocks / blocks_per_split)  # drop splits that would all be empty
        single_qsl = meta.query_start_loc if single_only else 0  # 0: every token
        part_acc: torch.Tensor | int = 0  # 0: a null pointer, no partial results (one split)
        part_ml: torch.Tensor | int = 0
        if num_splits > 1:
            part_acc = self.executor.empty((num_splits, t, num_heads, head_dim), torch.float32, device)
            part_ml = self.executor.empty((num_splits, t, num_heads, 2), torch.float32, device)
        self.executor.launch(
            name,
            device,
            (t, chunks, num_splits),
            (DECODE_THREADS,),
            (
                q,
                q.stride(0),
                q.stride(1),
                k_cache,
                v_cache,
                meta.block_tables,
                _i32(meta.block_tables.shape[1]),
                meta.positions,
                meta.token_seq,
                _i32(num_heads),
                _i32(num_kv_heads),
                _f32(scale * _LOG2E),
                _i32(min_blocks),
                single_qsl,
                out,
                part_acc,
                part_ml,
            ),
        )
        if num_splits > 1:
            self.executor.launch(
                merge_kernel(q.dtype, head_dim),
                device,
                (t, num_heads),
                (head_dim,),
                (part_acc, part_ml, _i32(num_splits), single_qsl, meta.token_seq, out),
            )

    def _prefill(self, q, k_cache, v_cache, meta, scale, out, skip_single: bool = False) -> None:
        device = q.device
        t, num_heads, head_dim = q.shape
        num_kv_heads = k_cache.shape[1]
        s = meta.seq_lens.shape[0]
        if uses_tensor_cores(q.dtype, num_heads, num_kv_heads, self.executor.capability(device)):
            name, threads = prefill_tc_kernel(q.dtype, head_dim), TC_THREADS
            tile_tokens = TC_ROWS // (num_heads // num_kv_heads)
            grid_y = num_kv_heads  # one CTA per KV head: the group's query heads share its K/V tiles
        else:
            name, threads, tile_tokens, grid_y = (
                prefill_kernel(q.dtype, head_dim),
                PREFILL_THREADS,
                PREFILL_ROWS,
                num_heads,
            )
        # Upper bound on the tile count without reading query_start_loc back (no host sync): every
        # sequence wastes at most one partial tile. Surplus CTAs exit immediately.
        tiles = math.ceil(t / tile_tokens) + s
        self.executor.launch(
            name,
            device,
            (tiles, grid_y),
            (threads,),
            (
                q,
                q.stride(0),
                q.stride(1),
                k_cache,
                v_cache,
                meta.block_tables,
                _i32(meta.block_tables.shape[1]),
                meta.query_start_loc,
                _i32(s),
                _i32(int(skip_single)),
                meta.positions,
                _i32(num_heads),
                _i32(num_kv_heads),
                _f32(scale * _LOG2E),
                out,
            ),
        )


@functools.lru_cache(maxsize=1)
def default_kernels() -> AttentionKernels:
    """The launchers on CuPy: what the engine uses on a CUDA device."""
    return AttentionKernels(CupyExecutor(kernel_source))


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    default_kernels().write_kv(k, v, k_cache, v_cache, slot_mapping)


def paged_attention(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    return default_kernels().paged_attention(q, k_cache, v_cache, meta, scale)


def paged_decode(q, k_cache, v_cache, meta, scale: float, *, num_splits: int | None = None) -> torch.Tensor:
    return default_kernels().paged_decode(q, k_cache, v_cache, meta, scale, num_splits=num_splits)


def paged_prefill(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    return default_kernels().paged_prefill(q, k_cache, v_cache, meta, scale)


def _i32(x: int) -> numpy.int32:
    return numpy.int32(x)


def _f32(x: float) -> numpy.float32:
    return numpy.float32(x)
