"""Embeddings, computed in the prefill chunks a request runs anyway (`docs/design.md#embeddings`).

A chunk that pools (`SeqStep.pooling`, set by the scheduler's `prompt_chunks.PromptPooler`) asks
the runner for the final hidden states of those positions as well (`pooled_rows`, after the
logits rows, `model_runner.execute_pooling`); `sums` adds each row's up in float32 and sends the
sum as bytes. The worker adds a request's chunks and divides by their count, so mean pooling over
many chunks and last-token pooling (one position) are the same record.
"""

from __future__ import annotations

import torch

from .step import StepBatch


def pooled_rows(batch: StepBatch) -> list[int]:
    """Flat token indices (into the step's token list) whose hidden states the pooling rows need,
    in batch order. Only called for a step with `pools`."""
    rows: list[int] = []
    offset = 0
    for s in batch.seqs:
        if s.pooling is not None:
            first, count = s.pooling
            rows.extend(range(offset + first, offset + first + count))
        offset += len(s.token_ids)
    return rows


def sums(hidden: torch.Tensor, batch: StepBatch) -> list[bytes]:
    """Each pooling row's sum of its positions' hidden states (`hidden` `[Q, dim]` in `pooled_rows`
    order), float32 little-endian bytes, one per pooling row in batch order."""
    counts = [s.pooling[1] for s in batch.seqs if s.pooling is not None]
    if hidden.shape[0] != sum(counts):
        raise ValueError(f"{hidden.shape[0]} rows of hidden states for {sum(counts)} pooled positions")
    parts = torch.split(hidden.float(), counts)
    # NOTE: one copy to the host for the whole step
    totals = torch.stack([p.sum(0) for p in parts]).cpu().numpy().astype("<f4")
    return [row.tobytes() for row in totals]
