"""The loglikelihood of a token sequence under a ModelRunner: one prefill, every position scored."""

from __future__ import annotations

import torch

from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch


def loglikelihood(runner, ids: list[int]) -> float:
    """Sum of log p(ids[i+1] | ids[:i+1]) over the sequence, in float64."""
    batch = StepBatch([SeqStep(0, ids, 0, list(range((len(ids) + 15) // 16)), RowSampling(temperature=0.0))])
    inputs = runner.prepare(batch)
    m = runner.model
    hidden = m.final_hidden(inputs.input_ids, inputs.meta, runner.kv_pool, torch.arange(len(ids)))
    logp = torch.log_softmax(m.head(hidden).double(), -1)
    return logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum().item()
