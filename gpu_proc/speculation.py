"""N-gram speculative decoding (prompt lookup), pure Python (`docs/design.md#speculative-decoding`).

A decode step at low concurrency costs what reading the weights costs, so a step that feeds a row
its last token plus k guessed ones costs about what a one-token step does. The guesses (the
*draft*) come from the row's own tokens: the longest suffix of its prompt + output, between
`ngram_min` and `ngram_max` tokens long, that occurred before, and the k tokens that followed its
first occurrence, as vLLM's n-gram proposer does (the first one leaves the most tokens to follow
in a loop). The step verifies the draft: the model's logits at
all k + 1 fed positions are sampled as if each were an ordinary step (same controls, same
uniform from (seed, index, position)), and the row keeps the longest prefix of the draft that
agrees, plus the token sampled after it. So every step emits 1 to k + 1 tokens.

Why that is exact. A draft token is a point mass q = 1[d]. Rejection sampling accepts it with
probability min(1, p(d) / q(d)) = p(d) and otherwise samples from the residual max(0, p - q),
which is p without d, renormalised. Sampling t from p by inverse CDF with the position's one
uniform and accepting exactly when t == d does both at once: P(accept) = p(d), and a rejected t is
distributed as p restricted to t != d. The output distribution is therefore p at every position,
and more: the emitted tokens are the ones plain decoding draws with the same seed, since both
use the same uniform at the same position over the same context (up to the floating-point
rounding of a batched forward). Greedy is the special case u -> argmax.

Adaptive. A draft token is worth its cost when the tokens it is expected to add per millisecond
beat what the step yields: a step of N decoding rows yields N tokens in T(N) ms, and a verified
position costs about what a row does, dT = T(N + 1) - T(N) (both from the admission cost model's
online fit). The step's drafts are chosen row by row: a row adds its j-th draft token while
P(kept) = rate^j >= dT x Y, where Y is the step's expected yield per ms with the drafts chosen so
far (`StepYield`), which each added token raises. At one row, where T is mostly reading the
weights, the bar starts at ~0.05; at 32 rows on a CPU, where T is mostly compute, at ~0.8, so
plain text (rate ~0.3) drafts nothing there and a copying row still does. `rate` is a row's
decayed share of kept draft tokens (counted up to the first rejection); a row that does not draft
still proposes and checks its first guess against the token it then samples, so a row whose
acceptance is low stops drafting, and starts again when its guesses start to come true.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

DECAY = 0.8  # weight of the past in a row's acceptance counts (about the last five drafts)
PRIOR_KEPT, PRIOR_TRIED = 1.0, 2.0  # a new row's rate: 0.5


@dataclass(slots=True)
class NgramIndex:
    """Where each n-gram (ngram_min <= n <= ngram_max) of a token list first ended, built as the
    list grows: `ends[hash((n, *gram))]` is the position of its last token, for grams ending
    before `indexed`. A hash collision only proposes a wrong draft, which verification rejects."""

    ngram_min: int
    ngram_max: int
    indexed: int = 0
    ends: dict[int, int] = field(default_factory=dict)

    def propose(self, tokens: Callable[[int, int], list[int]], length: int, k: int) -> list[int]:
        """Up to `k` tokens that followed the first occurrence of the longest suffix of the
        sequence that occurred before (none: []); `tokens(start, end)` reads the sequence, which
        has `length` tokens. Indexes the grams it has not seen yet as it goes."""
        last = length - 1
        lo, hi, ends = self.ngram_min, self.ngram_max, self.ends
        if self.indexed < last:  # grams ending before the last token
            base = max(0, self.indexed - hi + 1)
            seg = tokens(base, last)
            for end in range(self.indexed, last):
                e = end - base
                for n in range(lo, min(hi, end + 1) + 1):
                    ends.setdefault(hash((n, *seg[e - n + 1 : e + 1])), end)
            self.indexed = last
        tail = tokens(max(0, length - hi), length)
        for n in range(min(hi, last), lo - 1, -1):
            at = ends.get(hash((n, *tail[len(tail) - n :])))
            if at is not None:
                return tokens(at + 1, min(at + 1 + k, length))
        return []


def accepted_prefix(draft: list[int], sampled: list[int]) -> int:
    """How many draft tokens the target agrees with: the longest prefix of `draft` equal to the
    tokens sampled at its positions (`sampled[j]` is what follows the context up to `draft[:j]`)."""
    a = 0
    for d, t in zip(draft, sampled):
        if d != t:
            break
        a += 1
    return a


@dataclass(slots=True)
class _Row:
    """One request's proposer and its recent acceptance."""

    index: NgramIndex
    kept: float = PRIOR_KEPT  # decayed draft tokens kept
    tried: float = PRIOR_TRIED  # decayed draft tokens verified up to (and including) the first rejected one
    shadow_at: int = -1  # a proposal that was not sent: the position its first token guessed
    shadow: int = 0  # ... and that token

    def learn(self, kept: int, tried: int) -> None:
        self.kept = DECAY * self.kept + kept
        self.tried = DECAY * self.tried + tried


@dataclass(slots=True)
class StepYield:
    """A step's expected output as drafts are added to it: `tokens` expected in `ms`, each
    verified position costing `token_ms` more."""

    tokens: float
    ms: float
    token_ms: float

    @classmethod
    def for_step(cls, rows: int, step_ms: float, row_ms: float) -> StepYield:
        return cls(float(rows), max(step_ms, 1e-9), max(row_ms, 0.0))

    @property
    def bar(self) -> float:
        """The least P(kept) a further draft token needs to raise the step's tokens per ms."""
        return self.token_ms * self.tokens / self.ms

    def add(self, p_kept: float) -> None:
        self.tokens += p_kept
        self.ms += self.token_ms


class Speculator:
    """Drafts for the scheduler's decoding rows and the bookkeeping of their verification:
    vLLM's `spec_decode_*` counters (drafts verified, their tokens, the tokens kept, and per
    draft position the drafts whose token there was kept)."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        self.k = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self._rows: dict[object, _Row] = {}
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * num_tokens

    def propose(
        self, key: object, tokens: Callable[[int, int], list[int]], length: int, room: int, step: StepYield
    ) -> list[int]:
        """A draft of at most min(k, room) tokens for the row `key`, whose sequence (`length`
        tokens, read by `tokens(start, end)`) ends in its last token: as many of the proposal's
        tokens as raise the step's yield (`step` is updated for them); [] when none does, or
        nothing matches."""
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row(NgramIndex(self.ngram_min, self.ngram_max))
        if 0 <= row.shadow_at < length:  # the last proposal, unsent: was its first guess right?
            row.learn(int(tokens(row.shadow_at, row.shadow_at + 1)[0] == row.shadow), 1)
        row.shadow_at = -1
        n = min(self.k, room)
        proposal = row.index.propose(tokens, length, n) if n > 0 else []
        if not proposal:
            return []
        rate = row.kept / row.tried
        j, p = 0, rate
        while j < len(proposal) and p >= step.bar:
            step.add(p)
            j += 1
            p *= rate
        if j == 0:
            row.shadow_at, row.shadow = length, proposal[0]
        return proposal[:j]

    def record(self, key: object, drafted: int, accepted: int) -> None:
        """A row's draft of `drafted` tokens was verified and `accepted` of them kept."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        per = self.accepted_per_position
        for j in range(accepted):
            per[j] += 1
        row = self._rows.get(key)
        if row is not None:
            row.learn(accepted, accepted + (accepted < drafted))

    def rate(self, key: object) -> float | None:
        """A row's estimated chance that a draft token is kept (None: no row)."""
        row = self._rows.get(key)
        return row.kept / row.tried if row is not None else None

    def forget(self, key: object) -> None:
        self._rows.pop(key, None)
