"""Torch reference paged attention over a flat batch: the specification the CuPy kernels meet.

Two functions make a backend:

- `write_kv(k, v, k_cache, v_cache, slot_mapping)` stores the step's new keys and values in their
  slots (`k`, `v`: `[T, num_kv_heads, head_dim]`; caches: `[num_blocks, num_kv_heads, block_size,
  head_dim]`, see `kv_pool.py`).
- `paged_attention(q, k_cache, v_cache, meta, scale)` -> `[T, num_heads, head_dim]`. Every new token
  attends to its own sequence's keys at positions `0..its own position`: the cached prefix fully and
  the new tokens of its chunk causally. All of those are in the cache after `write_kv`, so attention
  reads only the cache, through the block table. Grouped-query attention: query head `h` reads KV
  head `h // (num_heads // num_kv_heads)`. Slots a token may not see can hold anything, NaN
  included (unwritten slots, a freed block's old contents): they never reach the output.

Work is proportional to each row's own context (`reference_plan.py`): decode rows are bucketed by
block count and each bucket is one vectorised pass (no Python loop per row); each prefill chunk
gathers its sequence's blocks once for all of its tokens. Softmax runs in float32 whatever the
cache dtype; probabilities are rounded to the cache dtype before P.V. `paged_attention_naive` is the
same math with every token padded to the step's longest context: the simplest statement of the
spec, kept for tests to compare the fast path against.
"""

from __future__ import annotations

import torch

from .metadata import AttentionMetadata
from .reference_plan import DecodeBucket, PrefillChunk, ReferencePlan, build_reference_plan

# Bounds the K/V gathered by one decode pass and the scores of one slice of a prefill chunk.
_GATHER_BUDGET_BYTES = 256 * 1024 * 1024


def _check_cache(name: str, cache: torch.Tensor, k: torch.Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(f"{name}: expected [num_blocks, num_kv_heads, block_size, head_dim], got {tuple(cache.shape)}")
    if cache.shape[1] != k.shape[1] or cache.shape[3] != k.shape[2]:
        raise ValueError(f"{name} {tuple(cache.shape)} does not match new keys {tuple(k.shape)}")


def write_kv(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new keys/values `[T, num_kv_heads, head_dim]` at their flat slots; a negative slot is
    padding and writes nothing (as in the kernel)."""
    _check_cache("k_cache", k_cache, k)
    _check_cache("v_cache", v_cache, v)
    # NOTE: without this, slot -1 would be block -1 by Python indexing: the pool's last block.
    padding = slot_mapping < 0
    if bool(padding.any()):
        keep = ~padding
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    block_size = k_cache.shape[2]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    offsets = slot_mapping % block_size
    # Advanced indices on dims 0 and 2 select [T, num_kv_heads, head_dim], the shape of k.
    k_cache[blocks, :, offsets] = k.to(k_cache.dtype)
    v_cache[blocks, :, offsets] = v.to(v_cache.dtype)


def paged_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """Causal attention of each new token over its sequence's cached keys. q: `[T, num_heads, head_dim]`."""
    group = _group(q, k_cache)
    _, num_kv_heads, block_size, head_dim = k_cache.shape
    if block_size != meta.block_size:
        raise ValueError(
            f"cache blocks hold {block_size} tokens but the step's block tables count {meta.block_size}-token blocks"
        )
    plan = meta.reference_plan
    # Built by the first layer of the step and reused by the others (same rows, same cache shape).
    if not isinstance(plan, ReferencePlan) or plan.num_kv_heads != num_kv_heads:
        row_bytes = 2 * num_kv_heads * block_size * head_dim * k_cache.element_size()  # K and V
        plan = meta.reference_plan = build_reference_plan(meta, num_kv_heads, row_bytes, _GATHER_BUDGET_BYTES)
    if len(plan.decode) == 1 and not plan.chunks:  # the common decode step: rows already in order
        return _decode_bucket(q, k_cache, v_cache, plan.decode[0], group, scale)
    out = torch.empty_like(q)
    for bucket in plan.decode:
        out[bucket.tokens] = _decode_bucket(q[bucket.tokens], k_cache, v_cache, bucket, group, scale)
    for chunk in plan.chunks:
        out[chunk.lo : chunk.hi] = _prefill_chunk(q[chunk.lo : chunk.hi], k_cache, v_cache, chunk, group, scale)
    return out


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled Q.K^T accumulated in float32 (for float32 caches the inputs are used as they are)."""
    return torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale


def _group(q: torch.Tensor, k_cache: torch.Tensor) -> int:
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[1]
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads // num_kv_heads


def _decode_bucket(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, bucket: DecodeBucket, group: int, scale: float
) -> torch.Tensor:
    """One query per row over the row's keys. q: `[n, num_heads, head_dim]` in bucket order."""
    n, num_heads, head_dim = q.shape
    num_kv_heads, ctx = k_cache.shape[1], bucket.ctx
    # Key by key straight into [n, kvh, ctx, d]: no permuted copy of the blocks, and positions past
    # a row's context read written data (see DecodeBucket), so NaN garbage is never gathered.
    k = k_cache.view(-1, head_dim).index_select(0, bucket.rows).view(n, num_kv_heads, ctx, head_dim)
    v = v_cache.view(-1, head_dim).index_select(0, bucket.rows).view(n, num_kv_heads, ctx, head_dim)
    qg = q.view(n, num_kv_heads, group, head_dim).to(k.dtype)  # [n, kvh, group, d]
    scores = _scores(qg, k, scale)  # [n, kvh, group, ctx]
    scores.masked_fill_(~bucket.valid[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(n, num_heads, head_dim).to(q.dtype)  # [n, kvh, group, d]


def _prefill_chunk(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk, group: int, scale: float
) -> torch.Tensor:
    """The chunk's queries `[n, num_heads, head_dim]` over its sequence's first `seq_len` keys."""
    n, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    seq_len = chunk.seq_len
    # [nb, kvh, bs, d] -> [kvh, nb * bs, d] -> the first seq_len keys: every one of them is written,
    # so no garbage slot is ever read here.
    k = k_cache.index_select(0, chunk.blocks).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
    v = v_cache.index_select(0, chunk.blocks).transpose(0, 1).reshape(num_kv_heads, -1, head_dim)[:, :seq_len]
    # Query rows in slices so the float32 scores [kvh, group * rows, seq_len] stay under the budget.
    rows = max(1, _GATHER_BUDGET_BYTES // max(1, 4 * num_heads * seq_len))
    out = torch.empty_like(q)
    for lo in range(0, n, rows):
        hi = min(n, lo + rows)
        m = hi - lo
        # [m, H, d] -> [kvh, group * m, d]: one matrix per KV head
        qg = (
            q[lo:hi]
            .view(m, num_kv_heads, group, head_dim)
            .permute(1, 2, 0, 3)
            .reshape(num_kv_heads, group * m, head_dim)
            .to(k.dtype)
        )
        scores = _scores(qg, k, scale)  # [kvh, group * m, seq_len]
        scores = scores.view(num_kv_heads, group, m, seq_len).masked_fill_(~chunk.allowed[lo:hi], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype).view(num_kv_heads, group * m, seq_len)
        o = torch.matmul(probs, v)  # [kvh, group * m, d]
        out[lo:hi] = o.view(num_kv_heads, group, m, head_dim).permute(2, 0, 1, 3).reshape(m, num_heads, head_dim)
    return out


def paged_attention_naive(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float
) -> torch.Tensor:
    """The spec in its plainest form: every token gathers its sequence's blocks up to the step's
    longest context and masks keys after its own position. Slow on mixed steps; for tests."""
    t, num_heads, head_dim = q.shape
    group = _group(q, k_cache)
    num_kv_heads, block_size = k_cache.shape[1], k_cache.shape[2]
    nblocks = (meta.max_seq_len + block_size - 1) // block_size
    idx = meta.block_tables[meta.token_seq, :nblocks].reshape(-1).long()  # [t * nblocks]
    k = k_cache.index_select(0, idx).view(t, nblocks, num_kv_heads, block_size, head_dim)
    v = v_cache.index_select(0, idx).view(t, nblocks, num_kv_heads, block_size, head_dim)
    # -> [t, kvh, ctx, d]: each token's keys and values in position order
    k = k.permute(0, 2, 1, 3, 4).reshape(t, num_kv_heads, nblocks * block_size, head_dim)
    v = v.permute(0, 2, 1, 3, 4).reshape(t, num_kv_heads, nblocks * block_size, head_dim)
    visible = torch.arange(nblocks * block_size, device=q.device)[None, :] <= meta.positions[:, None]  # [t, ctx]
    v = v.masked_fill(~visible[:, None, :, None], 0)
    qg = q.view(t, num_kv_heads, group, head_dim).to(k.dtype)
    scores = _scores(qg, k, scale)  # [t, kvh, group, ctx]
    scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(t, num_heads, head_dim).to(q.dtype)  # [t, kvh, group, d]
