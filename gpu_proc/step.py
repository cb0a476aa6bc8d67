"""The step description: what the scheduler hands the model runner for one forward pass.

Pure Python (no torch), so the scheduler core can build it. Decode rows and prefill chunks are the
same thing here — a run of new tokens for one sequence starting at `start_pos`, the number of its
tokens already in the KV cache — and together form one flat token list with no padding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class LogitsControls:
    """A request's logits controls, as vLLM defines them (`docs/design.md#sampling`): applied to
    the row's logits before it samples (`logits_processors.py`). Every default is neutral;
    `SamplingSpec` keeps None instead of an all-neutral instance, so such rows cost nothing."""

    presence_penalty: float = 0.0  # minus this for every token already in the output
    frequency_penalty: float = 0.0  # minus this per occurrence in the output
    repetition_penalty: float = 1.0  # tokens in the prompt or output: logit / p if > 0, else * p
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability (after temperature)
    min_tokens: int = 0  # the stop tokens (and EOS) are masked until this many were produced
    stop_token_ids: tuple[int, ...] = ()  # the request's own stop ids, for min_tokens
    logit_bias: tuple[tuple[int, float], ...] = ()  # added to the logits
    allowed_token_ids: tuple[int, ...] = ()  # non-empty: every other token is masked
    bad_words: tuple[tuple[int, ...], ...] = ()  # a sequence's last token is masked after its prefix

    def __post_init__(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        if not (self.repetition_penalty > 0 and math.isfinite(self.repetition_penalty)):
            raise ValueError(f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if any(not -100.0 <= b <= 100.0 for _, b in self.logit_bias):
            raise ValueError("logit_bias values must be in [-100, 100]")
        if any(not words for words in self.bad_words):
            raise ValueError("a bad_words entry must hold at least one token")

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def neutral(self) -> bool:
        return not (
            self.penalized
            or self.min_p
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
        )


@dataclass(frozen=True, slots=True, eq=False)
class RowControls:
    """A sample's controls and its token history, which the penalties and bad words read: the
    request's own lists, by reference (they grow as it samples; the step reads them as built)."""

    settings: LogitsControls
    prompt_ids: list[int]
    output_ids: list[int]


@dataclass(frozen=True, slots=True)
class PromptScoring:
    """Logprobs wanted from a prefill chunk: the logits at chunk offsets `first, first + 1, ...`
    scored against `targets`, the prompt tokens that follow those positions (the first of them is
    prompt token `start_pos + first + 1`), with `top_n` alternatives each."""

    first: int
    targets: list[int]
    top_n: int


@dataclass(frozen=True, slots=True)
class RowSampling:
    """How a sampling row draws its token. Randomness is a pure function of
    (seed, sample_index, position), so batch neighbours, preemption and restarts change nothing."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int = 0
    sample_index: int = 0
    logprobs: int | None = None  # top-N logprobs to return (0: the sampled token's only); None: none
    controls: RowControls | None = None  # None: no logits control (the common case)


@dataclass(slots=True)
class SeqStep:
    """One sequence's share of a step."""

    seq_id: int  # opaque to the runner; echoed back with its sample
    token_ids: list[int]  # the new tokens: 1 for a decode row, a chunk for prefill
    start_pos: int  # position of token_ids[0] == tokens of this sequence already cached
    block_table: list[int]  # KV blocks covering start_pos + len(token_ids) tokens, in order
    sampling: RowSampling | None = None  # set when this row samples after its last new token
    scoring: PromptScoring | None = None  # set when this chunk's prompt logprobs are wanted

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepBatch:
    seqs: list[SeqStep] = field(default_factory=list)
    scores_prompts: bool = False  # some row has `scoring` (checked once per step, not per row)
    finished: list[int] = field(default_factory=list)  # seq ids that ended since the last batch: free their state

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def sampling_seqs(self) -> list[SeqStep]:
        return [s for s in self.seqs if s.sampling is not None]
