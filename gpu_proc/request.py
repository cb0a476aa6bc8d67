"""A request as the scheduler tracks it: one sequence, as counters plus derived properties.

The sequence is `prompt_ids + generated`; `num_computed` counts the leading tokens whose keys and
values are in the KV cache. Prefill, decode, chunking and recompute after preemption are one rule:
a step feeds the request tokens `[num_computed, ...)` and it samples when the chunk reaches the end
of its sequence (so a recompute never re-samples, and never re-emits, a token it already streamed).

A Submit with `n` samples becomes `n` sibling requests (`sibling(i)`), as vLLM v1 fans out parallel
sampling: they share the Submit's (worker, rid) and seed, each has its own sample index, blocks and
cancel, and they share the prompt's KV blocks through the prefix cache (`docs/design.md#sampling`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from ringserve.gpu_proc.step import RowSampling
from ringserve.shm.messages import MAX_TIMELINE_EVENTS, CancelReason, SamplingParams

WorkerRid = tuple[int, int]  # (worker slot, rid): how a worker names its Submit on its ring


class RequestState(IntEnum):
    """Ordered so that waiting, running and finished are each one comparison."""

    QUEUED = 0
    PREEMPTED = 1
    PREFILL = 2
    DECODE = 3
    DONE = 4
    CANCELLED = 5


def tenant_cache_salt(tenant: str, salt: str | None) -> str:
    """The prefix-cache salt of a tenant's request: its own `cache_salt` within the tenant's space.
    NOTE: NUL cannot occur in a tenant (a key hash), so no pair of (tenant, salt) collides."""
    return f"tenant\x00{tenant}\x00{salt or ''}"


@dataclass(slots=True, eq=False)
class Request:
    """One sample's request record. Built from a worker's `Submit`; owned by the scheduler.
    Compared by identity: two samples of one Submit can hold equal fields."""

    key: WorkerRid
    request_id: str
    tenant: str  # who the fair queue shares the GPU between: the API key's owner
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams  # as the worker sent it (`rules.sampling_violation` checked it)
    arrival_ts: float
    deadline_ts: float
    n: int = 1  # samples the Submit asked for: this request and its n - 1 siblings
    index: int = 0  # this sample's index, 0 <= index < n
    logprobs: int | None = None
    cache_salt: str | None = None  # prefix-cache isolation: only equal salts share cached blocks
    prompt_logprobs: int | None = None  # top-N alternatives per prompt token; None: not scored
    fingerprint: int = 0  # the Submit's (`shm.messages.fingerprint`): names it in the step-in-flight record
    pooling: str | None = None  # an embedding: how its prompt's hidden states pool (`prompt_chunks.py`)
    lora: int = 0  # the LoRA adapter it runs (`lora.LoraRegistry` id); 0: the base model
    # where its time went (`shm.messages.Finish.timeline`), kept only for a traced Submit
    timeline: list[tuple[str, float, float, int]] | None = None
    # -- set by the scheduler ------------------------------------------------------------------
    seq_id: int = 0
    row_sampling: RowSampling | None = None  # the sampler's settings, with this sample's seed and index
    est_gpu_ms: float = 0.0
    queued_est_ms: float = 0.0  # what this request adds to queued_gpu_seconds while it waits
    starts_now: bool = False  # admitted as able to join at the next pass: not waiting work
    state: RequestState = RequestState.QUEUED
    queued_pass: int = 0  # the scheduler pass at which it last entered the queue (fair preemption)
    queued_ts: float = 0.0  # and the scheduler's clock then
    admit_seq: int = -1  # order of first admission to the running set; preemption takes the max
    generated: list[int] = field(default_factory=list)
    num_computed: int = 0
    block_ids: list[int] = field(default_factory=list)
    # Prefix-cache chain hashes of the full token blocks so far (a pure function of the tokens and
    # the salt, kept so a recompute or a repeated lookup does not rehash).
    block_hashes: list[int] = field(default_factory=list)
    cancel_reason: CancelReason | None = None
    prompt_scored: int = 1  # the next prompt token to score (token 0 has no logprob)
    prompt_pooled: int = 0  # the next prompt position whose hidden state is pooled
    first_join_ts: float | None = None
    first_token_ts: float | None = None
    preemptions: int = 0
    # NOTE: derived once: every sampled token of every row is looked up in it (O(1), not O(ids))
    stop_ids: frozenset[int] = field(init=False, default=frozenset())

    def __post_init__(self) -> None:
        self.stop_ids = frozenset(self.sampling.stop_token_ids)
        if not self.prompt_ids:
            raise ValueError("prompt_ids must not be empty")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if not 0 <= self.index < self.n:
            raise ValueError(f"sample index {self.index} is outside 0..{self.n - 1}")

    @classmethod
    def from_submit(cls, worker: int, msg, *, cache_per_tenant: bool = True, lora: int = 0) -> Request:
        """Build from a worker's `shm.messages.Submit`, running adapter `lora` (its id). `cache_per_tenant` (the config's default): the tenant salts the prefix cache too, so one
        tenant never reuses, and so can never time or count, another's cached prompt blocks. An
        adapter salts it always: blocks computed under one adapter (or none) never serve another."""
        salt = tenant_cache_salt(msg.tenant, msg.cache_salt) if cache_per_tenant else msg.cache_salt
        if lora:
            salt = f"lora\x00{lora}\x00{salt or ''}"
        return cls(
            key=(worker, msg.rid),
            request_id=msg.request_id,
            tenant=msg.tenant,
            prompt_ids=list(msg.prompt_ids),
            max_tokens=msg.max_tokens,
            sampling=msg.sampling,
            arrival_ts=msg.arrival_ts,
            deadline_ts=msg.deadline_ts,
            n=msg.n,
            logprobs=msg.logprobs,
            cache_salt=salt,
            prompt_logprobs=msg.prompt_logprobs,
            fingerprint=msg.fingerprint,
            pooling=msg.pooling,
            lora=lora,
            timeline=[] if msg.trace else None,
        )

    def mark(self, kind: str, start: float, end: float, count: int = 0) -> None:
        """Add an event to a traced request's timeline (`shm.messages.TIMELINE_KINDS`). The last
        place is kept for prompt chunks; once full, a chunk extends the last one."""
        timeline = self.timeline
        if timeline is None:
            return
        if len(timeline) < MAX_TIMELINE_EVENTS - 1:
            timeline.append((kind, start, end, count))
        elif kind == "chunk" and timeline[-1][0] == "chunk":
            timeline[-1] = ("chunk", timeline[-1][1], end, timeline[-1][3] + count)
        elif kind == "chunk" and len(timeline) < MAX_TIMELINE_EVENTS:
            timeline.append((kind, start, end, count))

    def sibling(self, index: int) -> Request:
        """Sample `index` of the same Submit: the same prompt and settings, none of the state. Only
        sample 0 scores the prompt (the prompt and its logprobs are the same for all)."""
        return Request(
            key=self.key,
            request_id=self.request_id,
            tenant=self.tenant,
            prompt_ids=self.prompt_ids,
            max_tokens=self.max_tokens,
            sampling=self.sampling,
            arrival_ts=self.arrival_ts,
            deadline_ts=self.deadline_ts,
            n=self.n,
            index=index,
            logprobs=self.logprobs,
            cache_salt=self.cache_salt,
            fingerprint=self.fingerprint,
            lora=self.lora,
            timeline=[] if self.timeline is not None else None,
        )

    # -- derived -------------------------------------------------------------------------------

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.generated)

    @property
    def sure_tokens(self) -> int:
        """Tokens this sample will generate unless cancelled or cut by the context: all of
        `max_tokens` with EOS ignored and no stop ids, else its `min_tokens` (admission prices
        at least these, whatever the recent answers were)."""
        sp = self.sampling
        if sp.ignore_eos and not sp.stop_token_ids:
            return self.max_tokens
        return min(sp.min_tokens, self.max_tokens)

    @property
    def scores_prompt(self) -> bool:
        """Prompt logprobs are still owed: its prefill chunks must run (no prefix-cache hits)."""
        return self.prompt_logprobs is not None and self.prompt_scored < len(self.prompt_ids)

    @property
    def reads_every_position(self) -> bool:
        """Its prefill must compute every prompt position (no prefix-cache hits): prompt logprobs
        are owed, or a mean pooling still needs hidden states a cached block does not keep."""
        return self.scores_prompt or (self.pooling == "mean" and self.prompt_pooled < len(self.prompt_ids))

    @property
    def is_waiting(self) -> bool:
        return self.state <= RequestState.PREEMPTED

    @property
    def is_running(self) -> bool:
        return RequestState.PREFILL <= self.state <= RequestState.DECODE

    @property
    def is_finished(self) -> bool:
        return self.state >= RequestState.DONE

    def tokens(self, start: int, end: int) -> list[int]:
        """Tokens `[start, end)` of `prompt_ids + generated`, without building the whole list."""
        prompt = self.prompt_ids
        plen = len(prompt)
        if end <= plen:
            return prompt[start:end]
        if start >= plen:
            return self.generated[start - plen : end - plen]
        return prompt[start:] + self.generated[: end - plen]
