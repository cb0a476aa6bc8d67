"""What a step holds, as the step cost model prices it (`cost_model.py`, `docs/design.md#cost-model`):
tokens fed through the layers, positions with logits, and the keys attention reads. Pure Python:
the scheduler builds one per step."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepShape:
    """What a step holds, as the cost model prices it (module docstring)."""

    decode: int = 0  # decode rows' tokens: each row's next token and its draft tokens (all have logits)
    prefill: int = 0  # prefill-chunk tokens (prompt or recompute)
    logits: int = 0  # positions with logits among the prefill tokens: sampling chunks' last, scored prompt tokens
    reads: int = 0  # attention: sum over the step's tokens of the keys each attends to

    @classmethod
    def decode_rows(cls, rows: int, context: int) -> StepShape:
        """`rows` decode rows each at `context` tokens of context (reading context + 1 keys)."""
        return cls(decode=rows, reads=rows * (context + 1))

    @classmethod
    def chunk(cls, start: int, tokens: int, samples: bool = True) -> StepShape:
        """A prefill chunk of `tokens` after `start` cached tokens."""
        return cls(prefill=tokens, logits=int(samples and tokens > 0), reads=chunk_reads(start, tokens))

    def __add__(self, other: StepShape) -> StepShape:
        return StepShape(
            self.decode + other.decode,
            self.prefill + other.prefill,
            self.logits + other.logits,
            self.reads + other.reads,
        )

    @property
    def kind(self) -> str:
        """decode (no prefill chunk), prefill (no decode row) or mixed: `StepAudit`'s kinds."""
        if not self.prefill:
            return "decode"
        return "mixed" if self.decode else "prefill"

    @property
    def empty(self) -> bool:
        return not (self.decode or self.prefill)


def chunk_reads(start: int, tokens: int) -> int:
    """Keys read by a causal chunk of `tokens` after `start` cached ones: sum of start + 1 .. start + tokens."""
    return tokens * start + tokens * (tokens + 1) // 2
