"""One step's token budget (`docs/design.md#scheduler-pass`): decode rows, prefill chunks and
prompt scoring all draw from it, so the pass has one place that says how big a step may be.

A step holds one token per decoding row and then prompt chunks up to the prefill budget. The
prefill budget rises when few rows decode, `prefill_budget x min(8, max_rows // decode_rows)`,
never below `prefill_budget`, so the total stall a chunk imposes on decoding users (rows x extra
step time) stays what it is at a full batch. Prompt logprobs are scored for at most
`PROMPT_LOGPROB_TOKENS_PER_STEP` prompt tokens a step, all rows together (each needs a row of
logits and travels in the step's output record).
"""

from __future__ import annotations

from dataclasses import dataclass

from ringserve.rules import PROMPT_LOGPROB_TOKENS_PER_STEP


def prefill_tokens_for(prefill_budget: int, max_rows: int, decode_rows: int) -> int:
    """Prompt tokens allowed in a step with `decode_rows` decoding rows (see the module doc)."""
    return prefill_budget * max(1, min(8, max_rows // max(decode_rows, 1)))


@dataclass(slots=True)
class StepBudget:
    """What is left of one step's tokens: `decode_rows` tokens went to the decoding rows, and
    `prefill_left` prompt tokens and `scoring_left` scored prompt tokens may still be added."""

    decode_rows: int
    prefill_left: int
    scoring_left: int

    @classmethod
    def for_step(cls, prefill_budget: int, max_rows: int, decode_rows: int) -> StepBudget:
        return cls(
            decode_rows, prefill_tokens_for(prefill_budget, max_rows, decode_rows), PROMPT_LOGPROB_TOKENS_PER_STEP
        )

    def take_prefill(self, tokens: int) -> None:
        if not 0 <= tokens <= self.prefill_left:
            raise ValueError(f"a chunk of {tokens} tokens is over the {self.prefill_left} left in this step")
        self.prefill_left -= tokens

    def take_scoring(self, tokens: int) -> None:
        if not 0 <= tokens <= self.scoring_left:
            raise ValueError(f"{tokens} scored tokens are over the {self.scoring_left} left in this step")
        self.scoring_left -= tokens
