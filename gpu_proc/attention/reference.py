"""Torch reference paged attention over a flat batch: the specification the CuPy kernels meet.

Two functions make a backend:

- `write_kv(k, v, k_cache, v_cache, slot_mapping)` stores the step's new keys and values in their
  slots (`k`, `v`: `[T, num_kv_heads, head_dim]`; caches: `[num_blocks, num_kv_heads, block_size,
  head_dim]`, see `kv_pool.py`).
- `paged_attention(q, k_cache, v_cache, meta, scale)` -> `[T, num_heads, head_dim]`. Every new token
  attends to its own sequence's keys at positions `0..its own position`: the cached prefix fully and
  the new tokens of its chunk causally. All of those are in the cache after `write_kv`, so attention
  reads only the cache, through the block table. Grouped-query attention: query head `h` reads KV
  head `h // (num_heads // num_kv_heads)`.

The reference is vectorised over tokens (no Python loop per row or per layer): each token gathers
its sequence's blocks, scores them with one batched matmul, and masks keys past its position. Memory
for the gathered keys grows with tokens x context, so tokens are processed in slices that keep the
gather under `_GATHER_BUDGET_BYTES`; the tiny model and typical decode steps take one slice.
Softmax runs in float32 whatever the cache dtype.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata

_GATHER_BUDGET_BYTES = 256 * 1024 * 1024


def _check_cache(name: str, cache: torch.Tensor, k: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name}: expected [num_blocks, num_kv_heads, block_size, head_dim], got {tuple(cache.shape)}")
    if cache.shape[1] != k.shape[1] or cache.shape[3] != k.shape[2]:
        raise ValueError(f"{name} {tuple(cache.shape)} does not match new keys {tuple(k.shape)}")


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values `[T, num_kv_heads, head_dim]` at their flat slots."""
    _check_cache("k_cache", k_cache, k)
    _check_cache("v_cache", v_cache, v)
    block_size = k_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    # Advanced indices on dims 0 and 2 select [T, num_kv_heads, head_dim], the shape of k.
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys. q: `[T, num_heads, head_dim]`."""
    t, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    group = num_heads // num_kv_heads
    nblocks = (meta.max_seq_len + block_size - 1) // block_size
    ctx = nblocks * block_size
    per_token = ctx * num_kv_heads * head_dim * k_cache.element_size() * 2  # K and V gathers
    step = max(1, min(t, _GATHER_BUDGET_BYTES // max(per_token, 1)))
    key_pos = torch.arange(ctx, device=q.device)
    out = torch.empty_like(q)
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        out[lo:hi] = _attend(q[lo:hi], k_cache, v_cache, meta.block_tables[meta.token_seq[lo:hi], :nblocks],
                             meta.positions[lo:hi], key_pos, group, scale)
    return out


def _attend(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
            positions: torch.Tensor, key_pos: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    n, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    nblocks = tables.shape[1]
    idx = tables.reshape(-1).long()
    # Gathered blocks stay in cache layout: [n, nblocks, kvh, bs, d]. Matmuls batch over
    # (token, block, kv head), so the big K/V gathers are never permuted into another copy.
    k = k_cache.index_select(0, idx).view(n, nblocks, num_kv_heads, block_size, head_dim)
    v = v_cache.index_select(0, idx).view(n, nblocks, num_kv_heads, block_size, head_dim)
    qg = q.view(n, 1, num_kv_heads, group, head_dim).to(k.dtype)  # [n, 1, kvh, group, d]
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [n, nblocks, kvh, group, bs]
    # [n, nblocks, kvh, group, bs] -> [n, kvh, group, nblocks * bs]: keys in position order
    scores = scores.permute(0, 2, 3, 1, 4).reshape(n, num_kv_heads, group, nblocks * block_size).float() * scale
    # Keys after the token's own position are the future of its chunk or unwritten/padding slots.
    masked = key_pos[None, :] > positions[:, None]  # [n, ctx]
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    # [n, kvh, group, nblocks, bs] -> [n, nblocks, kvh, group, bs] to meet V block by block
    probs = probs.view(n, num_kv_heads, group, nblocks, block_size).permute(0, 3, 1, 2, 4)
    out = torch.matmul(probs, v).sum(dim=1)  # [n, nblocks, kvh, group, d] -> [n, kvh, group, d]
    return out.reshape(n, num_heads, head_dim).to(q.dtype)
