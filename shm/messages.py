"""Every message that crosses a ring: `msgspec.Struct`s forming one tagged union, msgpack-encoded.

Workers name their requests with an integer `rid`, so per-token records stay small; the string
`request_id` travels once, in `Submit`, for logs. Per step the GPU process sends one `StepOutput`
per worker holding all of that worker's new tokens and finishes.

A worker numbers its requests from `first_rid(slot_generation)`: rids are unique per worker slot
across worker restarts, so a record a dead worker left in a ring (a Submit the GPU process had not
read yet, output it never read) can never name a request of its successor in the same slot, and the
GPU process drops exactly the dead worker's requests (`rid_generation`).
"""

from __future__ import annotations

import hashlib
from enum import StrEnum

import msgspec

_RID_GENERATION_SHIFT = 32


def first_rid(slot_generation: int) -> int:
    """The first rid of a worker started under `slot_generation` (its predecessors used lower ones)."""
    return (slot_generation << _RID_GENERATION_SHIFT) + 1


def rid_generation(rid: int) -> int:
    """The slot generation of the worker that numbered `rid`."""
    return rid >> _RID_GENERATION_SHIFT


class FinishReason(StrEnum):
    """Why a sample ended: on the wire (`shm.messages.Finish`), in the metrics' labels, and, through
    `client`, what the API reports as the choice's `finish_reason`."""

    STOP = "stop"  # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the context limit
    CANCELLED = "cancelled"  # the client went away, DELETE, a slow reader, a worker restart
    DEADLINE = "deadline"  # the request's deadline passed
    ERROR = "error"  # the GPU process failed it

    @property
    def client(self) -> str:
        """The OpenAI `finish_reason` (a passed deadline reads as cancelled, as on vLLM)."""
        return _CLIENT_REASON[self]

    @property
    def wasted(self) -> bool:
        """Its generated tokens count as `cancelled_tokens`: nobody reads them to the end."""
        return self in (FinishReason.CANCELLED, FinishReason.DEADLINE)


_CLIENT_REASON = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.CANCELLED: "cancelled",
    FinishReason.DEADLINE: "cancelled",
    FinishReason.ERROR: "error",
}


class CancelReason(StrEnum):
    """Why a worker cancels a request (`shm.messages.Cancel`); `finish` is how the sample ends."""

    CANCELLED = "cancelled"  # DELETE, a worker restart, a full output ring, one prompt of a refused batch
    DELETE = "delete"  # DELETE /v1/requests/{id} (the worker's record; it cancels on the wire as CANCELLED)
    STOP = "stop"  # a stop string matched in the worker
    DISCONNECT = "disconnect"  # the client closed its connection
    SLOW_READER = "slow_reader"  # the client read nothing for the slow-reader timeout

    @property
    def finish(self) -> FinishReason:
        return FinishReason.STOP if self is CancelReason.STOP else FinishReason.CANCELLED


FINISH_REASONS = tuple(FinishReason)

# Per-request limits both sides enforce (docs/design.md#limits-and-timeouts): the worker refuses
# a request over them with a 400, and the GPU process refuses a Submit over them.
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1  # no vocabulary is larger; a bigger id would not fit the int32 the model reads
MAX_REQUEST_ID_CHARS = 128
# Draft tokens a row may verify in one step (`--num-speculative-tokens`' bound): the GPU stats declare
# an acceptance counter per draft position (`shm.stats_schema`), and the config checks against it.
MAX_SPECULATIVE_TOKENS = 16
MAX_CACHE_SALT_CHARS = 1024  # vLLM's limit
MAX_LORA_NAME_CHARS = 128  # an adapter's name (`Submit.lora`)
MAX_LORA_ADAPTERS = 32  # adapters one server serves (the GPU stats count rows for each)
MAX_LORA_PATH_CHARS = 1024  # an adapter's checkpoint path (`LoadLora.path`)
MAX_METRICS_TENANTS = 32  # tenants with their own label on /metrics (`--metrics-tenants`); the rest: "other"
# The logits controls (docs/design.md#sampling) that grow a Submit: entries of `logit_bias`
# (OpenAI documents 300 as its own limit; we take more), ids of `allowed_token_ids`, and
# `bad_words` after tokenizing (vLLM's VLLM_MAX_NUM_BAD_WORDS default), each a short token sequence.
MAX_LOGIT_BIAS = 1024
MAX_ALLOWED_TOKEN_IDS = 4096
MAX_BAD_WORDS = 128
MAX_BAD_WORD_TOKENS = 32
MAX_TOP_LOGPROBS = 20  # top alternatives per token (`logprobs`, `prompt_logprobs`); vLLM's default
# A constrained request's grammar, in llguidance's serialized form (`api/structured_output.py`):
# a JSON schema, regex, choice list or Lark grammar as the client sent it plus a small envelope.
MAX_GRAMMAR_CHARS = 64 * 1024


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A request's sampling settings: the one type for them, from the worker's parsing to the GPU
    process's rows. Validated by `ringserve.rules.sampling_violation`, on both sides."""

    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None  # None: the GPU process draws one at admission
    stop_token_ids: tuple[int, ...] = ()  # at most MAX_STOP_TOKEN_IDS
    ignore_eos: bool = False
    # vLLM's logits controls; every default is neutral (a request that sets none pays nothing)
    presence_penalty: float = 0.0  # in [-2, 2]
    frequency_penalty: float = 0.0  # in [-2, 2]
    repetition_penalty: float = 1.0  # > 0
    min_p: float = 0.0  # in [0, 1]
    min_tokens: int = 0  # stop tokens are masked until this many tokens were produced
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]), sorted by id
    allowed_token_ids: tuple[int, ...] = ()  # empty: every token; sorted, distinct
    bad_words: tuple[tuple[int, ...], ...] = ()  # token sequences never to complete
    # Structured output: the grammar every sampled token must keep the answer inside (llguidance's
    # serialized grammar, built and checked by the worker); None: unconstrained
    grammar: str | None = None

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def controlled(self) -> bool:
        """Any logits control is set (a row without one pays nothing for them)."""
        return bool(
            self.penalized
            or self.min_p
            or self.min_tokens
            or self.logit_bias
            or self.allowed_token_ids
            or self.bad_words
            or self.grammar is not None
        )


class Submit(msgspec.Struct, frozen=True, kw_only=True, tag="submit"):
    rid: int
    request_id: str
    tenant: str
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    arrival_ts: float  # time.time() at the worker
    deadline_ts: float  # time.time() after which the row is removed
    n: int = 1
    logprobs: int | None = None  # top-N logprobs per token (0: the sampled token's only); None: none
    prompt_logprobs: int | None = None  # top-N logprobs per prompt token; None: none at all
    # Prefix-cache isolation: only requests with the same salt share cached KV blocks; a tenant
    # sets one to keep its prompts out of timing side channels (None: the shared cache).
    cache_salt: str | None = None
    # `fingerprint(...)` of this request, set by its worker: names it across a resubmission and a
    # client's resend, in the step-in-flight record and the quarantine (`shm/in_flight.py`)
    fingerprint: int = 0
    # Embeddings (`/v1/embeddings`): pool the prompt's final hidden states (one of POOLING_TYPES)
    # into `Pooled` records instead of showing generated text; None: a generation.
    pooling: str | None = None
    # The LoRA adapter (`--lora-modules` name) the request runs; None: the base model.
    lora: str | None = None
    # Record where its time goes on the GPU (`Finish.timeline`): the worker traces it or its
    # client asked for its timing.
    trace: bool = False


POOLING_TYPES = ("last", "mean")  # the last prompt token's hidden state, or the mean of them all


class Cancel(msgspec.Struct, frozen=True, kw_only=True, tag="cancel"):
    rid: int
    reason: CancelReason = CancelReason.CANCELLED
    index: int | None = None  # one sample of an n > 1 request (a stop string ended it); None: all


class LoadLora(msgspec.Struct, frozen=True, kw_only=True, tag="load_lora"):
    """Load the PEFT checkpoint at `path` as adapter `name` (`/v1/load_lora_adapter`); answered
    with Accepted or Rejected under `rid`, a rid of the sending worker's."""

    rid: int
    name: str
    path: str


class UnloadLora(msgspec.Struct, frozen=True, kw_only=True, tag="unload_lora"):
    """Stop serving adapter `name` (`/v1/unload_lora_adapter`): new requests naming it are 404s,
    those already queued or running finish. Answered like LoadLora."""

    rid: int
    name: str


class Accepted(msgspec.Struct, frozen=True, kw_only=True, tag="accepted"):
    rid: int
    est_gpu_ms: float


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag="rejected"):
    """Admission refused: `status` is the HTTP status the worker answers with."""

    rid: int
    status: int  # 400 | 429 | 503
    code: str
    message: str
    retry_after_s: float | None = None
    est_gpu_ms: float = 0.0  # a 429's price (the worker's refusals at once read it: api/refusals.py)


class Token(msgspec.Struct, frozen=True, array_like=True):
    rid: int
    index: int  # sample index, 0 <= index < n
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None


MAX_TIMELINE_EVENTS = 64  # per sample; prompt chunks past it merge into the last one
# What a traced sample's timeline records, each (kind, start, end, count), Unix seconds of the GPU
# process: "join" / "resume" (it entered the running rows; count: tokens to compute), "chunk" (a
# step that computed `count` of its prompt or recompute tokens, from the step's build to its
# samples), "preempt" (its blocks freed; count: tokens generated so far), "grammar" (its matcher
# compiled before it could queue).
TIMELINE_KINDS = ("join", "resume", "chunk", "preempt", "grammar")


class Finish(msgspec.Struct, frozen=True, array_like=True):
    rid: int
    index: int
    reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float  # arrival at the worker to the first join
    ttft_ms: float  # arrival at the worker to the first token sampled
    prefill_ms: float = 0.0  # first join to first token (vLLM's request prefill time)
    decode_ms: float = 0.0  # first token to the last
    preemptions: int = 0
    timeline: list[tuple[str, float, float, int]] | None = None  # a traced sample's (Submit.trace)


class PromptLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprobs of prompt tokens `start, start + 1, ...` (position 0 has none), from one prefill
    chunk: each token's logprob and rank (1: the most probable), and the top-N alternatives when
    the request asked for N > 0."""

    rid: int
    start: int
    logprobs: list[float]
    ranks: list[int]
    top: list[list[tuple[int, float]]] | None = None


class Pooled(msgspec.Struct, frozen=True, array_like=True):
    """The sum of the final (normed) hidden states at prompt positions `start .. start + count - 1`,
    float32 little-endian bytes, from one prefill chunk of a pooling request: the worker adds its
    chunks and divides by their count (one chunk of one position for last-token pooling)."""

    rid: int
    start: int
    count: int
    values: bytes


class StepOutput(msgspec.Struct, frozen=True, kw_only=True, tag="step"):
    """All of one worker's news from one step."""

    step: int
    tokens: list[Token] = []
    finishes: list[Finish] = []
    prompt_logprobs: list[PromptLogprobs] = []
    pooled: list[Pooled] = []


class Error(msgspec.Struct, frozen=True, kw_only=True, tag="error"):
    """A failure the worker must turn into an error for one request (rid) or all (rid None)."""

    code: str
    message: str
    rid: int | None = None


Message = Submit | Cancel | LoadLora | UnloadLora | Accepted | Rejected | StepOutput | Error
ToGpu = Submit | Cancel | LoadLora | UnloadLora  # what a worker sends
MESSAGE_TYPES = (
    SamplingParams,
    Submit,
    Cancel,
    LoadLora,
    UnloadLora,
    Accepted,
    Rejected,
    Token,
    Finish,
    PromptLogprobs,
    Pooled,
    StepOutput,
    Error,
)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def max_submit_bytes(context_limit: int) -> int:
    """An upper bound on the encoded size of a Submit for any request that passed validation
    (prompt + max_tokens within `context_limit`, token ids below 2**31), so the supervisor checks
    the ring record limit once at start-up instead of a legal request ever failing it."""
    ids = 5 * (context_limit + MAX_STOP_TOKEN_IDS + MAX_ALLOWED_TOKEN_IDS)  # msgpack uint32 or less
    bias = (5 + 9 + 1) * MAX_LOGIT_BIAS  # (id, float64) pairs
    bad = (5 * MAX_BAD_WORD_TOKENS + 3) * MAX_BAD_WORDS
    strings = 4 * (MAX_REQUEST_ID_CHARS + MAX_CACHE_SALT_CHARS + MAX_GRAMMAR_CHARS + MAX_LORA_NAME_CHARS) + 64  # UTF-8
    return ids + bias + bad + strings + 1024  # field names, scalars and headers


def max_step_output_bytes(max_rows: int, prompt_positions: int, hidden_size: int = 0) -> int:
    """An upper bound on one StepOutput record: a token (with MAX_TOP_LOGPROBS alternatives), a
    finish and a pooled sum of `hidden_size` float32s for each of `max_rows` rows, and prompt
    logprobs for `prompt_positions` prompt tokens (the GPU process scores at most that many per
    step, `gpu_proc/step.py`), each with MAX_TOP_LOGPROBS alternatives. The supervisor checks it
    against the ring record limit."""
    pair = 5 + 9 + 1  # (id, float64)
    per_token = 32 + pair * MAX_TOP_LOGPROBS
    per_finish = 64
    per_prompt_token = 9 + 5 + 3 + pair * MAX_TOP_LOGPROBS
    per_pooled = 4 * hidden_size + 32
    return max_rows * (per_token + per_finish + per_pooled + 32) + prompt_positions * per_prompt_token + 256


def fingerprint(msg: Submit, key: bytes) -> int:
    """What makes two Submits the same request, as a keyed 64-bit hash (never 0): the tenant, the
    prompt and every parameter, not the rid, request id, arrival or deadline. Keyed with the
    instance's random key (`Control.fingerprint_key`), so a fingerprint in a log reveals nothing
    of a prompt, not even to someone testing guesses."""
    same = msgspec.structs.replace(msg, rid=0, request_id="", arrival_ts=0.0, deadline_ts=0.0, fingerprint=0)
    return int.from_bytes(hashlib.blake2b(_encoder.encode(same), digest_size=8, key=key).digest(), "little") | 1


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(buf: bytes | memoryview) -> Message:
    return _decoder.decode(buf)
