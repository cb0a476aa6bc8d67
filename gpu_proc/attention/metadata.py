"""Attention metadata: the index tensors one step's attention needs, built once per step by the
model runner's `step_inputs.build_step_inputs`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ringserve.config import DEFAULTS


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
    block_size: int = DEFAULTS.block_size
    single_rows: int = -1  # sequences with one new token (decode rows); -1: every sequence
    reference_plan: object | None = None
    checked_num_blocks: int = 0  # pool size the CUDA launchers' value checks passed for (once per step)

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]
