"""Argument checks for the CuPy attention kernels, run before every launch.

The kernels index raw device memory, so a wrong shape, dtype, stride or device would read or write
the wrong bytes instead of failing. Each check raises ValueError (shape, layout, device) or
TypeError (dtype) naming the argument and what it should be. They run on any device, so CPU tests
exercise them; `require_cuda` is the one check that needs CUDA.
"""

from __future__ import annotations

import torch

BLOCK_SIZE = 16
HEAD_DIMS = (32, 64, 128)
# fp16/bf16 serve; fp32 exists so the CUDA engine can be compared token for token with the CPU one.
DTYPE_NAMES = {torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}


def _check_device(name: str, t: torch.Tensor, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}, expected {device} (all arguments on one CUDA device)")


def _check_aligned(name: str, t: torch.Tensor) -> None:
    if t.data_ptr() % 16:
        raise ValueError(
            f"{name}: data must be 16-byte aligned for vector loads; pass a fresh tensor, not a view at an odd offset"
        )


def _check_cache(name: str, cache: torch.Tensor, device: torch.device) -> None:
    _check_device(name, cache, device)
    if cache.dtype not in DTYPE_NAMES:
        raise TypeError(f"{name}: dtype {cache.dtype} unsupported; the kernels take float16, bfloat16 or float32")
    if cache.dim() != 4 or cache.shape[2] != BLOCK_SIZE:
        raise ValueError(
            f"{name}: expected [num_blocks, num_kv_heads, {BLOCK_SIZE}, head_dim], got {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise ValueError(f"{name}: must be contiguous (the kernels index blocks by flat offset)")
    _check_aligned(name, cache)


def _check_rows(
    name: str, x: torch.Tensor, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> None:
    """x: [T, heads, head_dim] with heads packed ([heads, head_dim] contiguous); the row stride may
    be larger (a view of a fused projection) but must keep 16-byte alignment."""
    _check_device(name, x, device)
    if x.dtype != dtype:
        raise TypeError(f"{name}: dtype {x.dtype} does not match the cache dtype {dtype}")
    if x.dim() != 3 or x.shape[1] != heads or x.shape[2] != head_dim:
        raise ValueError(f"{name}: expected [T, {heads}, {head_dim}], got {tuple(x.shape)}")
    if x.shape[0] == 0:
        return
    # NOTE: the stride of a size-1 dimension is never used for addressing, so it is not checked.
    if x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) != head_dim):
        raise ValueError(
            f"{name}: strides {x.stride()} unsupported; heads and channels must be contiguous (call .contiguous())"
        )
    if x.shape[0] > 1 and (x.stride(0) * x.element_size()) % 16:
        raise ValueError(f"{name}: row stride {x.stride(0)} elements is not a multiple of 16 bytes")
    _check_aligned(name, x)


def _check_index(name: str, x: torch.Tensor, dtype: torch.dtype, shape: tuple, device: torch.device) -> None:
    _check_device(name, x, device)
    if x.dtype != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError(f"{name}: must be contiguous")


def require_cuda(k_cache) -> torch.device:
    device = k_cache.device if isinstance(k_cache, torch.Tensor) else None
    if device is None or device.type != "cuda":
        raise ValueError(
            f"k_cache must be a CUDA tensor for the CuPy kernels, got "
            f"{getattr(k_cache, 'device', type(k_cache).__name__)}"
        )
    return device


def _check_caches(k_cache, v_cache) -> torch.device:
    """The K and V caches: tensors of one layer's pool, alike in shape and dtype; their device."""
    if not isinstance(k_cache, torch.Tensor):
        raise TypeError(f"k_cache: expected a torch.Tensor, got {type(k_cache).__name__}")
    device = k_cache.device
    _check_cache("k_cache", k_cache, device)
    _check_cache("v_cache", v_cache, device)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache does not match k_cache: {tuple(v_cache.shape)} {v_cache.dtype} against "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    return device


def check_write_kv_args(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Everything `write_kv` checks before launching, on any device (raises ValueError/TypeError)."""
    device = _check_caches(k_cache, v_cache)
    _, num_kv_heads, _, head_dim = k_cache.shape
    if (head_dim * k_cache.element_size()) % 16:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 8 for 16-byte copies")
    _check_rows("k", k, num_kv_heads, head_dim, k_cache.dtype, device)
    _check_rows("v", v, num_kv_heads, head_dim, k_cache.dtype, device)
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"v has {v.shape[0]} rows, k has {k.shape[0]}")
    _check_index("slot_mapping", slot_mapping, torch.int64, (k.shape[0],), device)


def check_attention_args(q, k_cache, v_cache, meta) -> torch.device:
    """Everything the attention launchers check before launching, on any device; returns the device."""
    device = _check_caches(k_cache, v_cache)
    num_kv_heads, head_dim = k_cache.shape[1], k_cache.shape[3]
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} unsupported; kernels exist for {HEAD_DIMS}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q: expected [T, num_heads, head_dim], got {getattr(q, 'shape', type(q))}")
    num_heads = q.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"q has {num_heads} heads, not a multiple of num_kv_heads {num_kv_heads}")
    _check_rows("q", q, num_heads, head_dim, k_cache.dtype, device)
    t, s = q.shape[0], meta.seq_lens.shape[0]
    _check_index("meta.positions", meta.positions, torch.int64, (t,), device)
    _check_index("meta.token_seq", meta.token_seq, torch.int64, (t,), device)
    _check_index("meta.query_start_loc", meta.query_start_loc, torch.int32, (s + 1,), device)
    _check_index("meta.seq_lens", meta.seq_lens, torch.int32, (s,), device)
    bt = meta.block_tables
    _check_index("meta.block_tables", bt, torch.int32, (s, bt.shape[1] if bt.dim() == 2 else -1), device)
    if t and bt.shape[1] * BLOCK_SIZE < meta.max_seq_len:
        raise ValueError(f"meta.block_tables has {bt.shape[1]} columns, too few for max_seq_len {meta.max_seq_len}")
    return device


def check_block_tables(meta, num_blocks: int) -> None:
    """Every block id in the step's block tables is inside the pool of `num_blocks`, and every
    token's position has a column in its table: otherwise a kernel would read another pool's memory
    or past the table.

    On the CPU (the kernel harness) a violation raises ValueError. On CUDA reading the tables back
    would stall the stream, so the check runs as a device-side assert (`torch._assert_async`): a
    violation fails the next synchronising call, the GPU process exits and is restarted, and no
    kernel has served a row from a block it does not own. It runs once per step: the result is
    remembered on the metadata (`checked_num_blocks`), which every layer shares.
    """
    if meta.checked_num_blocks == num_blocks:
        return
    bt, positions = meta.block_tables, meta.positions
    if bt.numel() == 0 or positions.numel() == 0:
        meta.checked_num_blocks = num_blocks
        return
    limit = bt.shape[1] * BLOCK_SIZE
    if bt.device.type == "cpu":
        lo, hi = int(bt.min()), int(bt.max())
        if lo < 0 or hi >= num_blocks:
            bad = lo if lo < 0 else hi
            raise ValueError(f"meta.block_tables holds block id {bad}, outside the pool of {num_blocks} blocks")
        p_lo, p_hi = int(positions.min()), int(positions.max())
        if p_lo < 0 or p_hi >= limit:
            bad = p_lo if p_lo < 0 else p_hi
            raise ValueError(
                f"meta.positions holds {bad}, outside the {bt.shape[1]} block-table columns ({limit} positions)"
            )
    else:
        ok = (bt.min() >= 0) & (bt.max() < num_blocks) & (positions.min() >= 0) & (positions.max() < limit)
        torch._assert_async(ok, "attention: a block id outside the KV pool or a position past the block table")
    meta.checked_num_blocks = num_blocks
