"""Prompt logprobs in the scheduler: which prefill chunks score which prompt tokens (pure Python;
the logits side is `prompt_logprobs.py`), `docs/design.md#sampling`.

A request that asks for prompt logprobs scores its prompt in the prefill chunks it runs anyway, at
most the step budget's scoring allowance (`PROMPT_LOGPROB_TOKENS_PER_STEP` for all rows together):
a chunk is cut where the allowance runs out, and a recompute after preemption never scores a token
twice. The logits at position q score prompt token q + 1 (token 0 has no logprob).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ringserve.gpu_proc.step import PromptScoring
from ringserve.shm.messages import PromptLogprobs

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
