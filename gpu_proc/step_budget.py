"""One step's budget (`docs/design.md#scheduler-pass`): decode rows, prefill chunks and prompt
scoring all draw from it, so the pass has one place that says how big a step may be.

A step holds one token per decoding row and then prompt chunks, within two limits:

- **tokens**: the prefill budget, which rises when few rows decode, `prefill_budget x min(8,
  max_rows // decode_rows)`, never below `prefill_budget` (it also bounds a step's activations,
  which the memory plan reserves room for);
- **time**: the step's estimated time (the step cost model's) is held to the step target
  (`Config.step_target`): each chunk is cut to the tokens whose estimated cost fits in what the
  decode rows and the chunks before it left. So a light tenant's request that arrives during a
  step waits at most one target for it, on any hardware; a long prompt is spread over many steps
  instead of freezing every stream for seconds.

Every step makes progress: the first chunk of a step gets at least `MIN_CHUNK_TOKENS` whatever
the estimate says (decode rows alone may take more than the target on a slow machine, and a
prefilling request must still move). Prompt logprobs are scored for at most
`PROMPT_LOGPROB_TOKENS_PER_STEP` prompt tokens a step, all rows together (each needs a row of
logits and travels in the step's output record).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.gpu_proc.cost_model import CostModel
from ringserve.gpu_proc.step_shape import StepShape
from ringserve.rules import PROMPT_LOGPROB_TOKENS_PER_STEP

MIN_CHUNK_TOKENS = 16  # what the first chunk of every step gets, time or not


def prefill_tokens_for(prefill_budget: int, max_rows: int, decode_rows: int) -> int:
    """Prompt tokens allowed in a step with `decode_rows` decoding rows (see the module doc)."""
    return prefill_budget * max(1, min(8, max_rows // max(decode_rows, 1)))


@dataclass(slots=True)
class StepBudget:
    """What is left of one step: `decode_rows` went to the decoding rows; `prefill_left` prompt
    tokens, `scoring_left` scored prompt tokens and `ms_left` estimated ms may still be added
    (`costs` prices a chunk; None: tokens only)."""

    decode_rows: int
    prefill_left: int
    scoring_left: int
    ms_left: float = float("inf")
    costs: CostModel | None = None
    chunks: int = 0
    filling: set[int] = field(default_factory=set)  # adapters copied into a slot for this step, priced in ms_left

    @classmethod
    def for_step(
        cls,
        prefill_budget: int,
        max_rows: int,
        decode_rows: int,
        ms_left: float = float("inf"),
        costs: CostModel | None = None,
    ) -> StepBudget:
        return cls(
            decode_rows,
            prefill_tokens_for(prefill_budget, max_rows, decode_rows),
            PROMPT_LOGPROB_TOKENS_PER_STEP,
            ms_left,
            costs,
        )

    def chunk_tokens(self, start: int, wanted: int) -> int:
        """The tokens a chunk of at most `wanted`, after `start` cached tokens, may have now."""
        n = min(wanted, self.prefill_left)
        if n > 0 and self.costs is not None:
            fits = self.costs.chunk_tokens_within(self.ms_left, start, n)
            n = fits if self.chunks else max(fits, min(n, MIN_CHUNK_TOKENS))
        return max(n, 0)

    def take_prefill(self, tokens: int, shape: StepShape | None = None) -> None:
        """A chunk of `tokens` joins the step (`shape`: what it adds, for the time left)."""
        if not 0 <= tokens <= self.prefill_left:
            raise ValueError(f"a chunk of {tokens} tokens is over the {self.prefill_left} left in this step")
        self.prefill_left -= tokens
        self.chunks += 1
        if shape is not None and self.costs is not None:
            self.ms_left -= self.costs.step_ms(shape) - self.costs.step_ms(StepShape())

    def take_scoring(self, tokens: int) -> None:
        if not 0 <= tokens <= self.scoring_left:
            raise ValueError(f"{tokens} scored tokens are over the {self.scoring_left} left in this step")
        self.scoring_left -= tokens
