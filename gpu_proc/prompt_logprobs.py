"""Prompt logprobs, computed in the prefill chunks a request runs anyway (`docs/design.md#sampling`).

A chunk that scores its prompt (`SeqStep.scoring`, set by the scheduler) asks the runner for the
logits of its positions as well as its last one: `logits_rows` lists those flat token indices,
which the runner appends after the sampling rows' (`model_runner.py`), so the model's head runs for
exactly those positions and nothing else changes in the forward. `score` turns their logits into
each prompt token's logprob and rank (vLLM's: how many tokens are at least as probable) and the
top-N alternatives, with the same `log_softmax` the sampled tokens' logprobs come from.
"""

from __future__ import annotations

import torch

from .host_tensor import host_tensor
from .step import StepBatch

# One scored chunk: (logprob per token, rank per token, top-N (id, logprob) pairs per token or None).
Scored = tuple[list[float], list[int], list[list[tuple[int, float]]] | None]


def logits_rows(batch: StepBatch) -> list[int]:
    """Flat token indices (into the step's token list) whose logits the scoring rows need, in
    batch order. Only called for a step with `scores_prompts`."""
    rows: list[int] = []
    offset = 0
    for s in batch.seqs:
        scoring = s.scoring
        if scoring is not None:
            first = offset + scoring.first
            rows.extend(range(first, first + len(scoring.targets)))
        offset += len(s.token_ids)
    return rows


def score(logits: torch.Tensor, batch: StepBatch) -> list[Scored]:
    """Logprobs of the scored prompt tokens from their positions' logits `[P, vocab]` (in
    `logits_rows` order), one result per scoring row in batch order."""
    scorings = [s.scoring for s in batch.seqs if s.scoring is not None]
    targets = host_tensor("q", [t for sc in scorings for t in sc.targets]).to(logits.device)
    if logits.shape[0] != targets.shape[0]:
        raise ValueError(f"{logits.shape[0]} rows of prompt logits for {targets.shape[0]} scored tokens")
    logp = torch.log_softmax(logits.float(), dim=-1)  # [P, vocab]
    lp = logp.gather(1, targets[:, None])  # [P, 1]
    ranks = (logp >= lp).sum(-1)  # [P]
    top_n = max(sc.top_n for sc in scorings)
    top = torch.topk(logp, min(top_n, logp.shape[-1]), dim=-1) if top_n else None
    lp_l, ranks_l = lp.squeeze(1).tolist(), ranks.tolist()
    top_ids = top.indices.tolist() if top is not None else None
    top_lp = top.values.tolist() if top is not None else None
    out: list[Scored] = []
    i = 0
    for sc in scorings:
        j = i + len(sc.targets)
        tops = None
        if sc.top_n and top_ids is not None and top_lp is not None:
            n = sc.top_n
            tops = [list(zip(ids[:n], vals[:n])) for ids, vals in zip(top_ids[i:j], top_lp[i:j])]
        out.append((lp_l[i:j], ranks_l[i:j], tops))
        i = j
    return out
