"""How the torch reference attention splits one step into work proportional to the real contexts.

A step mixes decode rows (one new token each) and prefill chunks (several new tokens of one
sequence). Padding every row to the step's longest context makes a 32-row decode step next to one
4k-token prompt pay 32 × 4k; the plan avoids that:

- decode rows are bucketed by block count in powers of two (1, 2, 3-4, 5-8, ... blocks) and padded
  only to the widest row of their bucket, so no row reads more than twice its own blocks; a bucket
  is cut into row slices that keep its K/V gather under a memory budget;
- each prefill chunk gathers its own sequence's blocks once, for all of its tokens.

The plan depends only on the step, so it is built once (on the first layer's call) and cached on
the step's `AttentionMetadata`; every layer reuses its index tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metadata import AttentionMetadata, host_tensor


@dataclass(frozen=True, slots=True)
class DecodeBucket:
    """Decode rows padded to `width` blocks.

    tokens  int64[n]            the rows' token indices in the step (their query rows)
    blocks  int64[n * width]    block ids, row-major; padding entries point at block 0
    valid   bool[n, width * bs] key position < the row's context length (False: padding or unwritten)
    """

    tokens: torch.Tensor
    blocks: torch.Tensor
    valid: torch.Tensor
    width: int


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
    decode: tuple[DecodeBucket, ...]
    chunks: tuple[PrefillChunk, ...]


def _width_class(nblocks: int) -> int:
    """Bucket key: rows with 1, 2, 3-4, 5-8, ... blocks share a bucket."""
    return (nblocks - 1).bit_length()


def build_reference_plan(meta: AttentionMetadata, row_bytes_per_block: int, budget_bytes: int) -> ReferencePlan:
    """Group the step's rows for the reference attention. `row_bytes_per_block` is what one row's
    gather of one block costs (K and V); a decode slice stays under `budget_bytes` (at least one row)."""
    bs = meta.block_size
    device = meta.seq_lens.device
    # NOTE: one host copy of two small index vectors per step (a sync on CUDA, where the reference
    # only runs in tests); everything after is grouping in Python over S rows.
    qsl = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    buckets: dict[int, list[int]] = {}
    chunk_seqs: list[int] = []
    for s, seq_len in enumerate(seq_lens):
        if qsl[s + 1] - qsl[s] == 1:
            buckets.setdefault(_width_class((seq_len + bs - 1) // bs), []).append(s)
        else:
            chunk_seqs.append(s)

    decode: list[DecodeBucket] = []
    for key in sorted(buckets):
        rows = buckets[key]
        width = max((seq_lens[s] + bs - 1) // bs for s in rows)
        per_slice = max(1, budget_bytes // max(1, width * row_bytes_per_block))
        for lo in range(0, len(rows), per_slice):
            part = rows[lo:lo + per_slice]
            idx = host_tensor("q", part).to(device)
            tokens = host_tensor("q", [qsl[s] for s in part]).to(device)
            blocks = meta.block_tables[idx, :width].reshape(-1).long()  # [n * width]
            key_pos = torch.arange(width * bs, device=device)
            valid = key_pos[None, :] < meta.seq_lens[idx].long()[:, None]  # [n, width * bs]
            decode.append(DecodeBucket(tokens, blocks, valid, width))

    chunks: list[PrefillChunk] = []
    for s in chunk_seqs:
        lo, hi, seq_len = qsl[s], qsl[s + 1], seq_lens[s]
        blocks = meta.block_tables[s, :(seq_len + bs - 1) // bs].long()
        first = seq_len - (hi - lo)  # position of the chunk's first new token
        q_pos = torch.arange(first, seq_len, device=device)
        allowed = torch.arange(seq_len, device=device)[None, :] <= q_pos[:, None]  # [n, seq_len]
        chunks.append(PrefillChunk(lo, hi, seq_len, blocks, allowed))
    return ReferencePlan(tuple(decode), tuple(chunks))
