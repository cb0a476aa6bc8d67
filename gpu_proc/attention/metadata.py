"""Attention metadata: the index tensors one step's attention needs, built once per step.

The step is one flat list of T new tokens from S sequences (decode rows and prefill chunks alike,
no padding). Building it is the runner's host overhead, so `build_step_inputs` does the per-row
work in plain Python lists and makes two host tensors (int64 and int32 fields; two host-to-device
copies); every field is a view cut from them.
"""

from __future__ import annotations

import operator
import struct
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

    `single_rows` counts the one-token sequences, known on the host when the step is built: the
    decode kernel's split planner sizes a mixed step's decode work from it (its chunk tokens' CTAs
    exit at once). `reference_plan` is the torch reference attention's grouping of this step's rows
    (`reference_plan.ReferencePlan`), built by its first layer and reused by the others; other
    backends leave it None. `checked_num_blocks` lets the kernel launchers check the tables'
    values once per step rather than in every layer (`cupy_checks.check_block_tables`).
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
    single_rows: int = -1  # sequences with one new token (decode rows); -1: every sequence
    reference_plan: object | None = None
    checked_num_blocks: int = 0  # pool size the CUDA launchers' value checks passed for (once per step)

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
    logits_indices: (
        torch.Tensor
    )  # int64[R]: the last new token of each sampling row (each verified one of a draft row), in batch order
    meta: AttentionMetadata


class StepBatchError(ValueError):
    """A step description the runner cannot execute (empty, or a block table too short)."""


_TORCH_TYPES = {"q": torch.int64, "i": torch.int32, "f": torch.float32}


def host_tensor(code: str, values: list) -> torch.Tensor:
    """A CPU tensor from a flat list: `struct` packs Python numbers about twice as fast as `array`
    and 5-8x faster than `torch.tensor(list)`, which matters at thousands of block ids per step.
    `code` is a struct code: "q" int64, "i" int32, "f" float32."""
    buf = bytearray(struct.calcsize(code) * len(values))
    struct.pack_into(f"{len(values)}{code}", buf, 0, *values)
    return torch.frombuffer(buf, dtype=_TORCH_TYPES[code]) if values else torch.empty(0, dtype=_TORCH_TYPES[code])


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
