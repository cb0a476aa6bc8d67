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

The reference is vectorised (no Python loop per row or per layer). Single-token rows (decode):
each token gathers its sequence's blocks, scores them with one batched matmul and masks keys past
its position; tokens go in slices that keep the gather under `_GATHER_BUDGET_BYTES` (typical steps
take one slice). Multi-token rows (prefill chunks): queries are padded per sequence and each such
sequence's blocks are gathered once for all of its tokens, so a 256-token chunk at 8k context does
not gather its context 256 times. Softmax runs in float32 whatever the cache dtype.
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
    key_pos = torch.arange(nblocks * block_size, device=q.device)
    if meta.max_query_len == 1:  # decode rows only
        return _by_token(q, k_cache, v_cache, meta.block_tables[meta.token_seq, :nblocks], meta.positions,
                         key_pos, group, scale)
    # Rows with several new tokens (prefill chunks) gather their sequence's blocks once for all of
    # their tokens; single-token rows gather per token. Each group is one vectorised pass.
    qlen = meta.query_start_loc[1:] - meta.query_start_loc[:-1]  # [S]
    multi = qlen > 1
    tok_multi = multi[meta.token_seq]  # [T]
    chunk_scores = int(multi.sum()) * num_heads * meta.max_query_len * key_pos.shape[0] * 4
    if chunk_scores > _GATHER_BUDGET_BYTES:  # huge chunks: bounded memory beats the shared gather
        return _by_token(q, k_cache, v_cache, meta.block_tables[meta.token_seq, :nblocks], meta.positions,
                         key_pos, group, scale)
    out = torch.empty_like(q)
    single = (~tok_multi).nonzero().squeeze(1)
    if single.numel():
        out[single] = _by_token(q[single], k_cache, v_cache, meta.block_tables[meta.token_seq[single], :nblocks],
                                meta.positions[single], key_pos, group, scale)
    chunk = tok_multi.nonzero().squeeze(1)
    out[chunk] = _by_sequence(q, chunk, multi, k_cache, v_cache, meta, nblocks, key_pos, group, scale)
    return out


def _by_token(q, k_cache, v_cache, tables, positions, key_pos, group, scale) -> torch.Tensor:
    """Each token gathers its own sequence's blocks; tokens in slices under the memory budget."""
    t, _, head_dim = q.shape
    per_token = key_pos.shape[0] * k_cache.shape[1] * head_dim * k_cache.element_size() * 2  # K and V
    step = max(1, min(t, _GATHER_BUDGET_BYTES // max(per_token, 1)))
    if step >= t:
        return _attend(q, k_cache, v_cache, tables, positions, key_pos, group, scale)
    out = torch.empty_like(q)
    for lo in range(0, t, step):
        hi = min(t, lo + step)
        out[lo:hi] = _attend(q[lo:hi], k_cache, v_cache, tables[lo:hi], positions[lo:hi], key_pos, group, scale)
    return out


def _by_sequence(q, chunk, multi, k_cache, v_cache, meta, nblocks, key_pos, group, scale) -> torch.Tensor:
    """Tokens `chunk` of multi-token rows: queries padded per sequence to `[SB, max_q]`, one gather
    of each such sequence's blocks. Returns `[len(chunk), num_heads, head_dim]`."""
    _, num_heads, head_dim = q.shape
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    seqs = multi.nonzero().squeeze(1)  # [SB]
    sb, max_q, ctx = seqs.shape[0], meta.max_query_len, key_pos.shape[0]
    tseq = meta.token_seq[chunk]
    row = (torch.cumsum(multi.long(), 0) - 1)[tseq]  # padded row of each chunk token
    col = chunk - meta.query_start_loc[tseq].long()  # its index within its chunk
    qp = q.new_zeros(sb, max_q, num_heads, head_dim)
    qp[row, col] = q[chunk]
    # Padding queries sit at position 0: they attend to one real key and are never read back.
    pos = torch.zeros(sb, max_q, dtype=torch.long, device=q.device)
    pos[row, col] = meta.positions[chunk]
    idx = meta.block_tables[seqs, :nblocks].reshape(-1).long()
    k = k_cache.index_select(0, idx).view(sb, nblocks, num_kv_heads, block_size, head_dim)
    v = v_cache.index_select(0, idx).view(sb, nblocks, num_kv_heads, block_size, head_dim)
    # [SB, max_q, H, d] -> [SB, 1, kvh, group * max_q, d]
    qg = qp.view(sb, max_q, num_kv_heads, group, head_dim).permute(0, 2, 3, 1, 4)
    qg = qg.reshape(sb, 1, num_kv_heads, group * max_q, head_dim).to(k.dtype)
    scores = torch.matmul(qg, k.transpose(-1, -2))  # [SB, nblocks, kvh, group * max_q, bs]
    # -> [SB, kvh, group, max_q, ctx]: keys in position order
    scores = scores.permute(0, 2, 3, 1, 4).reshape(sb, num_kv_heads, group, max_q, ctx).float() * scale
    masked = key_pos[None, None, :] > pos[:, :, None]  # [SB, max_q, ctx]
    scores.masked_fill_(masked[:, None, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    # [SB, kvh, group * max_q, nblocks, bs] -> [SB, nblocks, kvh, group * max_q, bs]
    probs = probs.view(sb, num_kv_heads, group * max_q, nblocks, block_size).permute(0, 3, 1, 2, 4)
    out = torch.matmul(probs, v).sum(dim=1)  # [SB, kvh, group * max_q, d]
    # [SB, kvh, group, max_q, d] -> [SB, max_q, H, d]
    out = out.view(sb, num_kv_heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(sb, max_q, num_heads, head_dim)
    return out[row, col].to(q.dtype)


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
