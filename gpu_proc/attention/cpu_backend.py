"""The CPU attention backend: compiled kernels that read K/V blocks where they lie (`csrc/cpu_attention.cpp`).

Same contract as `reference.py` (the spec, which the sweep test holds these to): `write_kv` stores
the step's new keys and values at their slots (slot -1: padding, skipped) with one copy per token
and head instead of an indexed assignment; `paged_attention` walks each sequence's block table,
attending every new token to the keys at positions `0..its own`, with no per-step gather of the
context and no plan to build. Softmax statistics and the P.V accumulation are float32 whatever the
cache dtype (float32 or bfloat16, also under float32 activations); slots a token may not see are
never read.

The launchers check what the kernels assume — shapes, dtypes, devices and strides — and raise
ValueError before the kernel runs; the kernels themselves check slot and block ids against the
cache, so a bad table is an error, never a read outside the pool.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata

DTYPES = (torch.float32, torch.bfloat16)
# float32 activations over a bfloat16 cache (`--kv-cache-dtype bfloat16`): stored rounded to
# nearest, the query rounded to bfloat16 for the scores, as the reference casts to the cache dtype.
MIXED = (torch.float32, torch.bfloat16)


def _check_rows(name: str, x: torch.Tensor, dtype: torch.dtype) -> None:
    if x.device.type != "cpu":
        raise ValueError(f"{name}: the CPU kernels need CPU tensors, got {x.device}")
    if x.dtype != dtype and (x.dtype, dtype) != MIXED:
        raise ValueError(f"{name}: dtype {x.dtype} differs from the cache's {dtype} (float32 over bfloat16 is allowed)")
    if x.dim() != 3 or x.stride(2) != 1 or (x.shape[1] > 1 and x.stride(1) < x.shape[2]):
        raise ValueError(
            f"{name}: expected [tokens, heads, head_dim] with head_dim contiguous, got shape "
            f"{tuple(x.shape)} strides {x.stride()}"
        )


def _check_cache(name: str, cache: torch.Tensor) -> None:
    if cache.dim() != 4 or not cache.is_contiguous():
        raise ValueError(
            f"{name}: expected a contiguous [num_blocks, num_kv_heads, block_size, head_dim] cache, "
            f"got shape {tuple(cache.shape)} strides {cache.stride()}"
        )
    if cache.dtype not in DTYPES or cache.device.type != "cpu":
        raise ValueError(
            f"{name}: the CPU kernels take float32 or bfloat16 CPU caches, got {cache.dtype} on {cache.device}"
        )


def _check_index(name: str, x: torch.Tensor, dtype: torch.dtype, dims: int) -> None:
    if x.dtype != dtype or x.dim() != dims or x.device.type != "cpu":
        raise ValueError(f"{name}: expected a {dims}-d {dtype} CPU tensor, got {x.dim()}-d {x.dtype} on {x.device}")
    if x.stride(-1) != 1:
        raise ValueError(f"{name}: last dimension must be contiguous, got strides {x.stride()}")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values `[T, num_kv_heads, head_dim]` at their flat slots (-1: skip)."""
    check_write(k, v, k_cache, v_cache, slot_mapping)
    torch.ops.ringserve_cpu.write_kv.default(k, v, k_cache, v_cache, slot_mapping)


def check_write(k, v, k_cache, v_cache, slot_mapping) -> None:
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if v_cache.shape != k_cache.shape or v_cache.dtype != k_cache.dtype:
        raise ValueError(
            f"v_cache {tuple(v_cache.shape)} {v_cache.dtype} differs from k_cache "
            f"{tuple(k_cache.shape)} {k_cache.dtype}"
        )
    _check_rows("k", k, k_cache.dtype)
    _check_rows("v", v, k_cache.dtype)
    if k.shape != v.shape or k.shape[1:] != (k_cache.shape[1], k_cache.shape[3]):
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match the cache {tuple(k_cache.shape)}")
    _check_index("slot_mapping", slot_mapping, torch.int64, 1)
    if slot_mapping.shape[0] != k.shape[0]:
        raise ValueError(f"slot_mapping has {slot_mapping.shape[0]} slots for {k.shape[0]} tokens")


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys. q: `[T, num_heads, head_dim]`."""
    check_attention(q, k_cache, v_cache, meta)
    out = torch.empty(q.shape, dtype=q.dtype)
    torch.ops.ringserve_cpu.paged_attention.default(
        q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables, scale, out
    )
    return out


def check_attention(q, k_cache, v_cache, meta: AttentionMetadata) -> None:
    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    _check_rows("q", q, k_cache.dtype)
    t, num_heads, head_dim = q.shape
    _, num_kv_heads, block_size, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or cache_dim != head_dim:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size != meta.block_size:
        raise ValueError(
            f"cache blocks hold {block_size} tokens but the step's block tables count {meta.block_size}-token blocks"
        )
    _check_index("query_start_loc", meta.query_start_loc, torch.int32, 1)
    _check_index("seq_lens", meta.seq_lens, torch.int32, 1)
    _check_index("block_tables", meta.block_tables, torch.int32, 2)
    s = meta.seq_lens.shape[0]
    if meta.query_start_loc.shape[0] != s + 1 or meta.block_tables.shape[0] != s or t != meta.num_tokens:
        raise ValueError(f"metadata for {s} sequences and {meta.num_tokens} tokens does not fit q {tuple(q.shape)}")
    if meta.max_seq_len > meta.block_tables.shape[1] * block_size:
        raise ValueError(
            f"a context of {meta.max_seq_len} tokens needs more than the "
            f"{meta.block_tables.shape[1]} blocks of the step's block tables"
        )
