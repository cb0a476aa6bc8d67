"""A request as the scheduler tracks it: the seed's record, as counters plus derived properties.

A request has `n` sample rows. Each row's sequence is `prompt_ids + generated`; `num_computed`
counts the leading tokens whose keys and values are in the KV cache. Prefill, decode, chunking and
recompute after preemption are one rule: a step feeds a row tokens `[num_computed, ...)` and the
row samples when the chunk reaches the end of its sequence (so a recomputed row never re-samples,
and never re-emits, a token it already streamed).

With `n > 1` the rows share the prompt: a prefix phase computes `prompt[:-1]` once into blocks the
rows then share by reference count; each row feeds the last prompt token itself, so its first
sample comes from its own row of logits, and the shared partial block is copied on write.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import IntEnum

from ringserve.gpu_proc.step import RowSampling

RequestKey = tuple[int, int]  # (worker, rid): workers number their requests with small ints


class RequestState(IntEnum):
    """Ordered so that waiting, running and finished are each one comparison."""

    QUEUED = 0
    PREEMPTED = 1
    PREFILL = 2
    DECODE = 3
    DONE = 4
    CANCELLED = 5


@dataclass(frozen=True, slots=True)
class SamplingSpec:
    """A request's sampling settings; `seed` None means the scheduler draws one at admission."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()  # checked for every sampled token: O(1) lookups
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.stop_token_ids, frozenset):
            object.__setattr__(self, "stop_token_ids", frozenset(self.stop_token_ids))
        if not (self.temperature >= 0.0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0: off), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(slots=True)
class SampleRow:
    """One of a request's `n` samples: its own generated tokens and block table."""

    index: int
    seq_id: int
    sampling: RowSampling  # the template with this row's seed and sample_index
    generated: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    # Prefix-cache chain hashes of this row's full token blocks so far (a pure function of the
    # tokens and the salt, kept so a recompute or a repeated lookup does not rehash).
    block_hashes: list[int] = field(default_factory=list)

    def num_tokens(self, prompt_len: int) -> int:
        return prompt_len + len(self.generated)

    def tokens(self, prompt: list[int], start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of `prompt + generated`, without building the whole list."""
        plen = len(prompt)
        if end <= plen:
            return prompt[start:end]
        if start >= plen:
            return self.generated[start - plen:end - plen]
        return prompt[start:] + self.generated[:end - plen]


@dataclass(slots=True)
class Request:
    """The seed's request record. Built from a worker's `Submit`; owned by the scheduler."""

    key: RequestKey
    request_id: str
    tenant: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingSpec
    arrival_ts: float
    deadline_ts: float
    n: int = 1
    logprobs: int | None = None
    cache_salt: str | None = None  # prefix-cache isolation: only equal salts share cached blocks
    # -- set by the scheduler ------------------------------------------------------------------
    est_gpu_ms: float = 0.0
    queued_est_ms: float = 0.0  # what this request adds to queued_gpu_seconds while it waits
    state: RequestState = RequestState.QUEUED
    rows: list[SampleRow] = field(default_factory=list)
    admit_seq: int = -1  # order of first admission to the running set; preemption takes the max
    prefix_seq_id: int = -1
    prefix_computed: int = 0  # n > 1 only: tokens of prompt[:-1] in the shared prefix blocks
    prefix_blocks: list[int] = field(default_factory=list)
    forked: bool = False  # n > 1: rows have taken over the prefix
    prefix_hashes: list[int] = field(default_factory=list)  # n > 1: chain hashes of prompt[:-1]'s full blocks
    cancel_reason: str | None = None
    first_join_ts: float | None = None
    first_token_ts: float | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")

    @classmethod
    def from_submit(cls, worker: int, msg) -> "Request":
        """Build from a worker's `shm.messages.Submit` (duck-typed: this core imports no shm)."""
        sp = msg.sampling
        return cls(key=(worker, msg.rid), request_id=msg.request_id, tenant=msg.tenant,
                   prompt_ids=list(msg.prompt_ids), max_tokens=msg.max_tokens,
                   sampling=SamplingSpec(temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p, seed=sp.seed,
                                         stop_token_ids=frozenset(sp.stop_token_ids), ignore_eos=sp.ignore_eos),
                   arrival_ts=msg.arrival_ts, deadline_ts=msg.deadline_ts, n=msg.n, logprobs=msg.logprobs,
                   cache_salt=msg.cache_salt)

    # -- derived -------------------------------------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def prefix_len(self) -> int:
        """Prompt tokens computed once and shared: all but the last when n > 1, else none."""
        return len(self.prompt_ids) - 1 if self.n > 1 else 0

    @property
    def is_waiting(self) -> bool:
        return self.state <= RequestState.PREEMPTED

    @property
    def is_running(self) -> bool:
        return RequestState.PREFILL <= self.state <= RequestState.DECODE

    @property
    def is_finished(self) -> bool:
        return self.state >= RequestState.DONE

    @property
    def live_rows(self) -> list[SampleRow]:
        return [r for r in self.rows if r.finish_reason is None]

    @property
    def num_generated(self) -> int:
        return sum(len(r.generated) for r in self.rows)

    @property
    def in_prefix_phase(self) -> bool:
        return self.n > 1 and not self.forked


@dataclass(slots=True)
class TokenEvent:
    """A sampled token for one row, to stream to the request's worker."""

    key: RequestKey
    index: int
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class FinishEvent:
    """A row ended; `reason` is one of shm.messages.FINISH_REASONS."""

    key: RequestKey
    index: int
    reason: str
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float
