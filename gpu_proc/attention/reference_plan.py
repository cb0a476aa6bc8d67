"""How the torch reference attention splits one step into work proportional to the real contexts.

A step mixes decode rows (one new token each) and prefill chunks (several new tokens of one
sequence). Padding every row to the step's longest context makes a 32-row decode step next to one
4k-token prompt pay 32 × 4k; the plan avoids that:

- decode rows are bucketed by block count: taken from the fewest blocks up, a bucket closes before
  the first row with more than twice, and more than `_SLACK_BLOCKS` more than, the blocks of its
  first row; every row is padded to the widest of its bucket. So no row reads more than twice its
  own blocks (or a few blocks more: each pass has a fixed cost of a dozen tensor ops, which at short
  contexts outweighs a little padding), and rows of similar context share one pass; a bucket is
  cut into row slices that keep its K/V gather under a memory budget;
- each prefill chunk gathers its own sequence's blocks once, for all of its tokens.

The plan depends only on the step, so it is built once (on the first layer's call) and cached on
the step's `AttentionMetadata`; every layer reuses its index tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..host_tensor import host_tensor
from .metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Decode rows padded to `ctx` key positions (a whole number of blocks).

    tokens  int64[n]               the rows' token indices in the step (their query rows)
    rows    int64[n * kvh * ctx]   for row r, KV head h, key position p: the cache row holding that
                                   key in the cache viewed as `[num_blocks * kvh * bs, head_dim]`
    valid   bool[n, ctx]           p < the row's context length

    NOTE: positions past a row's context point at its position 0 instead of at padding or unwritten
    slots, so the gathered keys and values are always written data (never NaN); `valid` masks them
    out of the scores.
    """

    tokens: torch.Tensor
    rows: torch.Tensor
    valid: torch.Tensor
    ctx: int


@dataclass(frozen=True, slots=True)
class PrefillChunk:
    """The new tokens `[lo, hi)` of one sequence whose context is `seq_len` tokens after this step.

    blocks   int64[ceil(seq_len / bs)]  the sequence's blocks, in position order
    allowed  bool[hi - lo, seq_len]    causal with offset: query i sees keys 0 .. seq_len - (hi - lo) + i
    """

    lo: int
    hi: int
    seq_len: int
    blocks: torch.Tensor
    allowed: torch.Tensor


@dataclass(frozen=True, slots=True)
class ReferencePlan:
    """One step's rows grouped for the reference attention; valid for caches with `num_kv_heads`
    KV heads (the decode rows index the cache by head)."""

    num_kv_heads: int
    decode: tuple[DecodeBucket, ...]
    chunks: tuple[PrefillChunk, ...]


_SLACK_BLOCKS = 8


def _buckets(nblocks: dict[int, int]) -> list[list[int]]:
    """Decode sequences (id -> block count) grouped so that a bucket's widest row has at most twice,
    or `_SLACK_BLOCKS` more than, the blocks of its narrowest; each bucket lists its sequences in
    step order."""
    groups: list[list[int]] = []
    first = 0
    for s in sorted(nblocks, key=nblocks.__getitem__):
        if not groups or nblocks[s] > max(2 * first, first + _SLACK_BLOCKS):
            groups.append([])
            first = nblocks[s]
        groups[-1].append(s)
    return [sorted(g) for g in groups]


def _bucket(meta: AttentionMetadata, seqs: list[int], tokens: list[int], width: int, num_kv_heads: int) -> DecodeBucket:
    bs = meta.block_size
    device = meta.seq_lens.device
    if len(seqs) == meta.num_seqs:  # every row of the step (the common decode step): no row gather
        seq_lens, tables = meta.seq_lens, meta.block_tables[:, :width]
    else:
        idx = host_tensor("q", seqs).to(device)
        seq_lens, tables = meta.seq_lens[idx], meta.block_tables[idx, :width]
    key_pos = torch.arange(width * bs, device=device)
    valid = key_pos[None, :] < seq_lens[:, None]  # [n, ctx]
    # Past the context: the row's first block at offset 0 (its position 0, always written).
    block = torch.where(valid, tables[:, key_pos // bs], tables[:, :1]).long()  # [n, ctx]
    offset = (key_pos % bs).masked_fill(~valid, 0)  # [n, ctx]
    heads = torch.arange(num_kv_heads, device=device)
    # [n, 1, ctx] and [1, kvh, 1] -> [n, kvh, ctx]: row (block * kvh + h) * bs + offset
    rows = (block[:, None, :] * num_kv_heads + heads[None, :, None]) * bs + offset[:, None, :]
    return DecodeBucket(host_tensor("q", tokens).to(device), rows.reshape(-1), valid, width * bs)


def build_reference_plan(
    meta: AttentionMetadata, num_kv_heads: int, row_bytes_per_block: int, budget_bytes: int
) -> ReferencePlan:
    """Group the step's rows for the reference attention. `row_bytes_per_block` is what one row's
    gather of one block costs (K and V); a decode slice stays under `budget_bytes` (at least one row)."""
    bs = meta.block_size
    device = meta.seq_lens.device
    # NOTE: one host copy of two small index vectors per step (a sync on CUDA, where the reference
    # only runs in tests); everything after is grouping in Python over S rows.
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    decode_blocks: dict[int, int] = {}
    chunk_seqs: list[int] = []
    for s, seq_len in enumerate(seq_lens):
        if qsl[s + 1] - qsl[s] == 1:
            decode_blocks[s] = (seq_len + bs - 1) // bs
        else:
            chunk_seqs.append(s)

    decode: list[DecodeBucket] = []
    for seqs in _buckets(decode_blocks):
        width = max(decode_blocks[s] for s in seqs)
        per_slice = max(1, budget_bytes // max(1, width * row_bytes_per_block))
        for lo in range(0, len(seqs), per_slice):
            part = seqs[lo : lo + per_slice]
            decode.append(_bucket(meta, part, [qsl[s] for s in part], width, num_kv_heads))

    chunks: list[PrefillChunk] = []
    for s in chunk_seqs:
        lo, hi, seq_len = qsl[s], qsl[s + 1], seq_lens[s]
        blocks = meta.block_tables[s, : (seq_len + bs - 1) // bs].long()
        first = seq_len - (hi - lo)  # position of the chunk's first new token
        q_pos = torch.arange(first, seq_len, device=device)
        allowed = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]  # [n, seq_len]
        chunks.append(PrefillChunk(lo, hi, seq_len, blocks, allowed))
    return ReferencePlan(num_kv_heads, tuple(decode), tuple(chunks))
