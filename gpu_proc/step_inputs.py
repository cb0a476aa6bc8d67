"""The model runner's input for one step: the token ids, the logits rows and the attention metadata.

The step is one flat list of T new tokens from S sequences (decode rows and prefill chunks alike,
no padding). Building it is the runner's host overhead, so `build_step_inputs` does the per-row
work in plain Python lists and makes two host tensors (int64 and int32 fields; two host-to-device
copies); every field is a view cut from them.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from .attention.metadata import AttentionMetadata
from .host_tensor import host_tensor
from .lora import LoraStep
from .step import StepBatch


@dataclass(slots=True)
class StepInputs:
    """Everything the forward needs for one step."""

    input_ids: torch.Tensor  # int64[T]
    # int64[R]: the last new token of each sampling row (each verified one of a draft row), in batch order
    logits_indices: torch.Tensor
    meta: AttentionMetadata
    lora: LoraStep | None = None  # the step's adapter rows (set by the runner, `lora.py`)


class StepBatchError(ValueError):
    """A step description the runner cannot execute (empty, or a block table too short)."""


def _raise_bad_row(seqs, block_size: int) -> None:
    for s in seqs:
        end = s.start_pos + len(s.token_ids)
        need = (end + block_size - 1) // block_size
        if not s.token_ids:
            raise StepBatchError(f"seq {s.seq_id}: no new tokens")
        if len(s.block_table) < need:
            raise StepBatchError(
                f"seq {s.seq_id}: block table has {len(s.block_table)} blocks, {need} needed for {end} tokens"
            )


def build_step_inputs(batch: StepBatch, block_size: int, device: torch.device) -> StepInputs:
    """Turn a step description into device tensors: one host tensor from flat lists, one copy."""
    seqs = batch.seqs
    if not seqs:
        raise StepBatchError("empty step: no sequences")
    # Column-wise list comprehensions instead of one loop body per row: this is the hot host path
    # (about half the time at 32-256 decode rows), and comprehensions run it at C speed.
    lens = [len(s.token_ids) for s in seqs]
    starts = [s.start_pos for s in seqs]
    seq_lens = [a + n for a, n in zip(starts, lens)]
    nblocks = [(e + block_size - 1) // block_size for e in seq_lens]
    tables_in = [s.block_table for s in seqs]
    if min(lens) == 0 or any(map(operator.lt, map(len, tables_in), nblocks)):
        _raise_bad_row(seqs, block_size)
    max_q = max(lens)
    max_len = max(seq_lens)
    width = max(nblocks)
    ns = len(seqs)
    if max_q == 1:  # decode rows only: one token per sequence
        ids = [s.token_ids[0] for s in seqs]
        positions = starts
        slots = [bt[p // block_size] * block_size + p % block_size for bt, p in zip(tables_in, starts)]
        token_seq = list(range(ns))
        qsl = list(range(ns + 1))
    else:
        ids = [t for s in seqs for t in s.token_ids]
        positions = [p for a, e in zip(starts, seq_lens) for p in range(a, e)]
        slots = [
            bt[p // block_size] * block_size + p % block_size
            for bt, a, e in zip(tables_in, starts, seq_lens)
            for p in range(a, e)
        ]
        token_seq = [i for i, n in enumerate(lens) for _ in range(n)]
        qsl = [0]
        total = 0
        for n in lens:
            total += n
            qsl.append(total)
    logits_indices = [qsl[i + 1] - 1 for i, s in enumerate(seqs) if s.sampling is not None]
    if batch.has_drafts:  # a draft row's logits at each verified position (`StepBatch.sampling_rows`)
        logits_indices = [
            j for i, s in enumerate(seqs) if s.sampling is not None for j in range(qsl[i + 1] - 1 - s.draft, qsl[i + 1])
        ]
    zeros = [0] * width
    tables: list[int] = []
    for bt, nb in zip(tables_in, nblocks):
        tables += bt if len(bt) == nb else bt[:nb]
        if nb < width:
            tables += zeros[nb:]

    t = len(ids)
    # int32 fields get their own buffer so nothing is converted on the device afterwards.
    flat = host_tensor("q", ids + positions + slots + token_seq + logits_indices)
    flat32 = host_tensor("i", qsl + seq_lens + tables)
    if device.type != "cpu":
        flat = flat.to(device, non_blocking=True)
        flat32 = flat32.to(device, non_blocking=True)
    meta = AttentionMetadata(
        slot_mapping=flat[2 * t : 3 * t],
        query_start_loc=flat32[: ns + 1],
        seq_lens=flat32[ns + 1 : 2 * ns + 1],
        block_tables=flat32[2 * ns + 1 :].view(ns, width),  # [S, max_blocks]
        positions=flat[t : 2 * t],
        token_seq=flat[3 * t : 4 * t],
        max_query_len=max_q,
        max_seq_len=max_len,
        block_size=block_size,
        single_rows=ns if max_q == 1 else lens.count(1),
    )
    return StepInputs(input_ids=flat[:t], logits_indices=flat[4 * t :], meta=meta)
