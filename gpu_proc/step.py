"""The step description: what the scheduler hands the model runner for one forward pass.

Pure Python (no torch), so the scheduler core can build it. Decode rows and prefill chunks are the
same thing here — a run of new tokens for one sequence starting at `start_pos`, the number of its
tokens already in the KV cache — and together form one flat token list with no padding.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ringserve.shm.messages import SamplingParams


@dataclass(frozen=True, slots=True, eq=False)
class RowControls:
    """A sample's logits controls (`docs/design.md#sampling`: its settings, with at least one
    control set) and its token history, which the penalties and bad words read: the request's own
    lists, by reference (they grow as it samples; the step reads them as built)."""

    settings: SamplingParams
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
    """How a sampling row draws its token: the per-row view of a request's `SamplingParams`, with
    its sample's seed and index. Randomness is a pure function of (seed, sample_index, position),
    so batch neighbours, preemption and restarts change nothing."""

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
    # Embeddings: the final hidden states at chunk offsets `first .. first + count - 1` are summed
    # (`pooling.py`); set as (first, count) when this chunk holds prompt positions a request pools.
    pooling: tuple[int, int] | None = None
    # Speculative decoding: the last `draft` new tokens are guesses (`speculation.py`), and the row
    # samples after each of its last draft + 1 tokens, so that the scheduler can verify them.
    draft: int = 0
    lora: int = 0  # the LoRA adapter the row runs (`lora.LoraRegistry` id); 0: the base model

    @property
    def context_len(self) -> int:
        return self.start_pos + len(self.token_ids)

    @property
    def drafted(self) -> list[int]:
        """The draft tokens this row is sampled after (the logits controls and masks count them as
        output already produced)."""
        return self.token_ids[len(self.token_ids) - self.draft :] if self.draft else []

    def verified_rows(self) -> list[SeqStep]:
        """One sampling row per position a draft row samples at: the row cut after its real token,
        then after each draft token (`context_len` is the position each one draws for)."""
        ids, first = self.token_ids, len(self.token_ids) - self.draft
        return [
            SeqStep(
                self.seq_id, ids[: first + j], self.start_pos, self.block_table, self.sampling, draft=j, lora=self.lora
            )
            for j in range(self.draft + 1)
        ]


@dataclass(slots=True)
class StepBatch:
    seqs: list[SeqStep] = field(default_factory=list)
    scores_prompts: bool = False  # some row has `scoring` (checked once per step, not per row)
    finished: list[int] = field(default_factory=list)  # seq ids that ended since the last batch: free their state
    has_drafts: bool = False  # some row has a `draft` (checked once per step, not per row)
    pools: bool = False  # some row has `pooling` (checked once per step, not per row)
    loras: bool = False  # some row runs a LoRA adapter (checked once per step, not per row)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def sampling_seqs(self) -> list[SeqStep]:
        return [s for s in self.seqs if s.sampling is not None]

    @property
    def sampling_rows(self) -> list[SeqStep]:
        """The rows the sampler draws for, in logits order: each sampling sequence, and for a draft
        row each of its verified positions (`SeqStep.verified_rows`)."""
        if not self.has_drafts:
            return self.sampling_seqs
        rows: list[SeqStep] = []
        for s in self.seqs:
            if s.sampling is not None:
                if s.draft:
                    rows += s.verified_rows()
                else:
                    rows.append(s)
        return rows
