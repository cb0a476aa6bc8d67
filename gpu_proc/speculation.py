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

Adaptive. A row whose drafts keep failing stops proposing for a while (`Speculator` doubles the
pause on each failure, up to `MAX_PAUSE_STEPS`); and the scheduler gives drafts only while the
step stays under `speculative_step_tokens` tokens, where a CPU step turns from reading weights
to computing (measured in docs/BENCHMARKS.md), so a large batch does not pay for guesses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

MIN_ACCEPT_RATE = 0.25  # a row accepting less of what it drafts (over its recent drafts) pauses
MAX_PAUSE_STEPS = 64
_DECAY = 0.7  # weight of the past in a row's acceptance estimate


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
    rate: float = 1.0  # decayed accepted / drafted over the row's drafts
    pause: int = 0  # steps left without drafting
    backoff: int = 1  # the next pause, doubled on each failure


@dataclass(frozen=True, slots=True)
class SpecStats:
    """vLLM's `spec_decode_*` counters (`vllm:spec_decode_num_drafts`, ...)."""

    drafts: int  # verified drafts (a row-step with at least one draft token)
    draft_tokens: int
    accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # [j]: drafts whose token j was accepted


class Speculator:
    """Drafts for the scheduler's decoding rows and the bookkeeping of their verification."""

    def __init__(self, num_tokens: int, ngram_min: int, ngram_max: int, step_tokens: int) -> None:
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {ngram_min}, {ngram_max}")
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_tokens}")
        self.k = num_tokens
        self.ngram_min = ngram_min
        self.ngram_max = ngram_max
        self.step_tokens = step_tokens  # a step's decode tokens + drafts stay within this
        self._rows: dict[object, _Row] = {}
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_position = [0] * num_tokens

    def budget(self, decode_rows: int) -> int:
        """Draft tokens a step with `decode_rows` decoding rows may carry (0: plain decode)."""
        return max(0, self.step_tokens - decode_rows)

    def propose(self, key: object, tokens: Callable[[int, int], list[int]], length: int, room: int) -> list[int]:
        """A draft of at most min(k, room) tokens for the row `key` whose sequence (`length`
        tokens, read by `tokens(start, end)`) ends in its last token ([] while the row is paused
        or nothing matches)."""
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = _Row(NgramIndex(self.ngram_min, self.ngram_max))
        if row.pause:
            row.pause -= 1
            return []
        n = min(self.k, room)
        return row.index.propose(tokens, length, n) if n > 0 else []

    def record(self, key: object, drafted: int, accepted: int) -> None:
        """A row's draft of `drafted` tokens was verified and `accepted` of them kept."""
        self.drafts += 1
        self.draft_tokens += drafted
        self.accepted_tokens += accepted
        per = self.accepted_per_position
        for j in range(accepted):
            per[j] += 1
        row = self._rows.get(key)
        if row is None:
            return
        row.rate = _DECAY * row.rate + (1.0 - _DECAY) * (accepted / drafted)
        if row.rate < MIN_ACCEPT_RATE:
            row.pause, row.backoff = row.backoff, min(2 * row.backoff, MAX_PAUSE_STEPS)
            row.rate = MIN_ACCEPT_RATE + (1.0 - _DECAY)  # a fresh chance after the pause
        elif accepted == drafted:
            row.backoff = 1

    def forget(self, key: object) -> None:
        self._rows.pop(key, None)

    def stats(self) -> SpecStats:
        return SpecStats(self.drafts, self.draft_tokens, self.accepted_tokens, tuple(self.accepted_per_position))
