"""What prefill chunks compute besides the KV cache, in the scheduler (pure Python): which chunks
score which prompt tokens (prompt logprobs; the logits side is `prompt_logprobs.py`,
`docs/design.md#sampling`) and which pool which positions' hidden states (embeddings; the torch
side is `pooling.py`, `docs/design.md#embeddings`).

A request that asks for prompt logprobs scores its prompt in the prefill chunks it runs anyway, at
most the step budget's scoring allowance (`PROMPT_LOGPROB_TOKENS_PER_STEP` for all rows together):
a chunk is cut where the allowance runs out, and a recompute after preemption never scores a token
twice. The logits at position q score prompt token q + 1 (token 0 has no logprob).

An embedding request pools in the chunks it runs anyway, too: every prompt position once (mean
pooling; `Request.reads_every_position` keeps its prefix-cache hits off), or the last one only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringserve.gpu_proc.step import PromptScoring
from ringserve.shm.messages import Pooled, PromptLogprobs

if TYPE_CHECKING:
    from ringserve.gpu_proc.request import Request
    from ringserve.gpu_proc.step_budget import StepBudget


class PromptScorer:
    """The chunks of the batch being built that score prompt tokens, and their results' events."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: list[tuple[Request, int]] = []  # (request, first prompt token scored), batch order

    def __bool__(self) -> bool:
        return bool(self._rows)

    def cut(self, req: Request, start: int, end: int, budget: StepBudget) -> tuple[int, PromptScoring | None]:
        """The chunk `[start, end)` of a request owed prompt logprobs, cut so it scores at most
        what `budget` allows and leaves no prompt token unscored behind it, and what it scores
        (drawn from the budget). An end equal to `start` means: compute nothing this step."""
        lo = max(start + 1, req.prompt_scored)
        hi = min(end, req.prompt_len - 1, lo + budget.scoring_left - 1)  # the last prompt token it scores
        if hi < min(end, req.prompt_len - 1):
            end = max(start, hi)  # stop where scoring stops, or score nothing and compute nothing
        if lo > hi:
            return end, None
        req.prompt_scored = hi + 1
        self._rows.append((req, lo))
        budget.take_scoring(hi + 1 - lo)
        return end, PromptScoring(lo - 1 - start, req.prompt_ids[lo : hi + 1], req.prompt_logprobs or 0)

    def results(self, scored) -> list[tuple[int, PromptLogprobs]]:
        """The wire events for the last batch's scored chunks: `scored` holds one (logprobs,
        ranks, top) per scoring row in batch order."""
        rows, self._rows = self._rows, []
        if scored is None or len(scored) != len(rows):
            raise ValueError(
                f"the last batch scored {len(rows)} prompt chunks but "
                f"{0 if scored is None else len(scored)} results were given"
            )
        return [
            (req.key[0], PromptLogprobs(req.key[1], start, logprobs, ranks, top))
            for (req, start), (logprobs, ranks, top) in zip(rows, scored)
        ]


class PromptPooler:
    """The chunks of the batch being built that pool prompt positions, and their results' events."""

    __slots__ = ("_rows",)

    def __init__(self) -> None:
        self._rows: list[tuple[Request, int, int]] = []  # (request, first position, count), batch order

    def __bool__(self) -> bool:
        return bool(self._rows)

    def cut(self, req: Request, start: int, end: int) -> tuple[int, int] | None:
        """The chunk offsets (first, count) whose hidden states the chunk `[start, end)` of a
        pooling request adds to its sum, or None; a recompute never pools a position twice."""
        if req.pooling == "mean":
            lo, hi = max(start, req.prompt_pooled), min(end, req.prompt_len)
        else:  # last: the chunk that reaches the prompt's end
            lo, hi = req.prompt_len - 1, req.prompt_len
            if not (req.prompt_pooled < hi and start <= lo < end):
                return None
        if lo >= hi:
            return None
        req.prompt_pooled = hi
        self._rows.append((req, lo, hi - lo))
        return lo - start, hi - lo

    def results(self, pooled) -> list[tuple[int, Pooled]]:
        """The wire events for the last batch's pooling chunks: `pooled` holds one float32 sum (as
        bytes) per pooling row in batch order."""
        rows, self._rows = self._rows, []
        if pooled is None or len(pooled) != len(rows):
            raise ValueError(
                f"the last batch pooled {len(rows)} prompt chunks but "
                f"{0 if pooled is None else len(pooled)} results were given"
            )
        return [(req.key[0], Pooled(req.key[1], lo, count, values)) for (req, lo, count), values in zip(rows, pooled)]
