"""Attention metadata: the index tensors one step's attention needs, built once per step.

The step is one flat list of T new tokens from S sequences (decode rows and prefill chunks alike,
no padding). Building it is the runner's host overhead, so `build_step_inputs` does the per-row
work in plain Python lists and makes exactly one host tensor (one host-to-device copy); the int32 views
are cut from it on the device.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import torch

from ..step import StepBatch


@dataclass(slots=True)
class AttentionMetadata:
    """Index tensors for one step, on the model's device.

    slot_mapping    int64[T]   flat KV slot (block_id * block_size + offset) of each new token
    query_start_loc int32[S+1] token range of sequence s is [query_start_loc[s], query_start_loc[s+1])
    seq_lens        int32[S]   context length after this step (cached + new)
    block_tables    int32[S, max_blocks]  padded with 0; entries past a row's length are never read
    positions       int64[T]   absolute position of each new token
    token_seq       int64[T]   sequence index (0..S-1) of each new token
    """

    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    positions: torch.Tensor
    token_seq: torch.Tensor
    max_query_len: int
    max_seq_len: int
    block_size: int = 16

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


@dataclass(slots=True)
class StepInputs:
    """Everything the forward needs for one step."""

    input_ids: torch.Tensor  # int64[T]
    logits_indices: torch.Tensor  # int64[R]: the last new token of each sampling row, in batch order
    meta: AttentionMetadata


class StepBatchError(ValueError):
    """A step description the runner cannot execute (empty, or a block table too short)."""


def build_step_inputs(batch: StepBatch, block_size: int, device: torch.device) -> StepInputs:
    """Turn a step description into device tensors: one host tensor from flat lists, one copy."""
    seqs = batch.seqs
    if not seqs:
        raise StepBatchError("empty step: no sequences")
    # The block-table width is known up front, so each row's padded table is appended in the one
    # pass over rows (a second pass costs as much as the first at 256 rows).
    max_len = max(s.start_pos + len(s.token_ids) for s in seqs)
    width = (max_len + block_size - 1) // block_size
    zeros = [0] * width
    ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    token_seq: list[int] = []
    qsl = [0]
    seq_lens: list[int] = []
    logits_indices: list[int] = []
    tables: list[int] = []
    max_q = 0
    total = 0
    for i, s in enumerate(seqs):
        n = len(s.token_ids)
        start = s.start_pos
        end = start + n
        bt = s.block_table
        nblocks = (end + block_size - 1) // block_size
        if n == 0:
            raise StepBatchError(f"seq {s.seq_id}: no new tokens")
        if len(bt) < nblocks:
            raise StepBatchError(
                f"seq {s.seq_id}: block table has {len(bt)} blocks, {nblocks} needed for {end} tokens")
        ids += s.token_ids
        if n == 1:  # decode row: skip the range/comprehension machinery
            positions.append(start)
            slots.append(bt[start // block_size] * block_size + start % block_size)
            token_seq.append(i)
        else:
            positions += range(start, end)
            slots += [bt[p // block_size] * block_size + p % block_size for p in range(start, end)]
            token_seq += [i] * n
            if n > max_q:
                max_q = n
        total += n
        qsl.append(total)
        seq_lens.append(end)
        if s.sampling is not None:
            logits_indices.append(total - 1)
        tables += bt[:nblocks] if len(bt) > nblocks else bt
        if nblocks < width:
            tables += zeros[nblocks:]
    max_q = max(max_q, 1)

    t, ns, r = len(ids), len(seqs), len(logits_indices)
    # array -> frombuffer converts a list about twice as fast as torch.tensor(list).
    flat = torch.frombuffer(array("q", ids + positions + slots + token_seq + logits_indices + qsl + seq_lens
                                  + tables), dtype=torch.int64)
    if flat.device != device:
        flat = flat.to(device, non_blocking=True)
    o = 4 * t + r
    meta = AttentionMetadata(
        slot_mapping=flat[2 * t:3 * t],
        query_start_loc=flat[o:o + ns + 1].to(torch.int32),
        seq_lens=flat[o + ns + 1:o + 2 * ns + 1].to(torch.int32),
        block_tables=flat[o + 2 * ns + 1:].view(ns, width).to(torch.int32),  # [S, max_blocks]
        positions=flat[t:2 * t],
        token_seq=flat[3 * t:4 * t],
        max_query_len=max_q,
        max_seq_len=max_len,
        block_size=block_size,
    )
    return StepInputs(input_ids=flat[:t], logits_indices=flat[4 * t:o], meta=meta)
