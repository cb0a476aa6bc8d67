"""vLLM's logits controls on the sampling rows' logits, before the sampler (`docs/design.md#sampling`).

Rows whose `RowSampling.controls` is set (the request asked for a non-neutral control) are
processed; the others are not touched, and a step without such rows does no work here at all.
The order is vLLM's: the structured-output grammar's mask first (`grammar.py` fills it while the
forward runs), then `allowed_token_ids`, `bad_words`, `min_tokens` (mask the stop tokens and EOS
until that many tokens were produced), `logit_bias`, then the penalties — repetition (over prompt
and output: a seen token's logit is divided by the penalty when positive, else multiplied),
frequency (minus the penalty per occurrence in the output) and presence (minus it once for any
token in the output) — then `min_p` (drop tokens below min_p times the top token's probability
at the row's temperature, written as the equivalent threshold on the logits:
`logit < max + temperature * ln(min_p)`). Top-k, top-p and the seeded draw follow in the sampler,
unchanged: randomness stays a pure function of (seed, index, position), so a seeded request with
penalties repeats exactly, alone or batched, preempted or not.

The logprobs a request gets are those of the raw distribution, as vLLM reports them: the sampler
sees the processed logits, and `ControlsPlan.report_raw` recomputes the logprobs of the processed
rows that asked for logprobs from a copy of their raw logits.

State. The penalties need each sequence's output token counts and the set of its prompt tokens.
They live on the device, one row of a slab per sequence (by seq id), updated with the tokens a
sequence produced since its last step (one, or a verified draft's few); a row whose count does not
match its output (it was evicted after a long wait, or is new) is rebuilt from the request's token lists, which the scheduler owns
(`RowControls` holds them by reference). A sequence's slot is freed the step after it ends (the
batch names it, `forget`); one that waits unused for `EVICT_AFTER_STEPS` steps (preempted, held
behind others) is freed too and rebuilt when it returns.
Speculative decoding: a draft row is sampled at each position it verifies (`SeqStep.verified_rows`),
and each position's controls count the draft tokens before it as output (penalties, bad words,
min_tokens), so a kept token was drawn exactly as plain decoding would have drawn it.
Bad-word prefixes are matched on the host against each row's last output tokens (bounded by
`shm.messages.MAX_BAD_WORDS` words of `MAX_BAD_WORD_TOKENS` tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .host_tensor import host_tensor
from .sampler import MIN_TEMPERATURE, SampleOutput
from .step import RowControls, RowSampling, SeqStep

if TYPE_CHECKING:
    from .grammar import GrammarMasks

EVICT_AFTER_STEPS = 256
MAX_NEW_TOKENS = 16  # output tokens a sequence may gain between steps and still be counted, not rebuilt
_NEG_INF = float("-inf")


@dataclass(slots=True)
class _Seq:
    slot: int
    counted: int  # output tokens included in the slot's counts
    last_step: int


class ControlsState:
    """The engine's side of the logits controls: per-sequence device state, and each step's `plan`
    (the executor applies it before the sampler, `executor.sample_rows`)."""

    def __init__(self, vocab_size: int, eos_token_ids, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos = tuple(sorted(eos_token_ids))
        self.device = device
        self.counts = torch.zeros(0, vocab_size, device=device)  # [slots, vocab] output counts
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [slots, vocab]
        self.seqs: dict[int, _Seq] = {}
        self._free: list[int] = []
        self._step = 0

    # -- the plan (host) --------------------------------------------------------------------------

    def plan(self, rows: list[SeqStep], grammar: GrammarMasks | None = None) -> ControlsPlan | None:
        """The step's controls as a few device tensors; None when no row has any."""
        sampling = row_settings(rows)
        chosen = [(i, r.controls) for i, r in enumerate(sampling) if r.controls is not None]
        if not chosen:
            return None
        self._step += 1
        picked = [i for i, _ in chosen]
        controls = [c for _, c in chosen]
        vocab = self.vocab_size
        keep_rows: list[int] = []  # allowed_token_ids: rows and (row, token) pairs to keep
        keep: list[int] = []
        ban: list[int] = []  # flattened (row, token) pairs to mask: bad words, min_tokens
        bias_at: list[int] = []
        bias: list[float] = []
        pen_rows: list[int] = []
        pen_slots: list[int] = []
        pen: list[float] = []  # repetition, frequency, presence per penalized row
        minp_rows: list[int] = []
        minp_shift: list[float] = []
        new_tokens: list[int] = []  # (slot, token) pairs to count
        draft_counts: list[int] = []  # flat (penalized row, token) pairs: a verified position's draft
        for j, c in enumerate(controls):
            st = c.settings
            base = j * vocab
            if st.allowed_token_ids:
                keep_rows.append(j)
                keep += [base + t for t in st.allowed_token_ids]
            row = rows[picked[j]]
            drafted = row.drafted  # a verified position sees the draft before it as output
            if st.bad_words:
                ban += [base + t for t in _banned(st.bad_words, c.output_ids + drafted if drafted else c.output_ids)]
            if len(c.output_ids) + len(drafted) < st.min_tokens:
                ban += [base + t for t in st.stop_token_ids + self.eos if t < vocab]
            if st.logit_bias:
                bias_at += [base + t for t, _ in st.logit_bias]
                bias += [b for _, b in st.logit_bias]
            if st.penalized:
                pen_rows.append(j)
                pen_slots.append(self._sync(row.seq_id, c, new_tokens))
                draft_counts += [(len(pen_rows) - 1) * vocab + t for t in drafted]
                pen += (st.repetition_penalty, st.frequency_penalty, st.presence_penalty)
            temperature = sampling[picked[j]].temperature
            if st.min_p > 0.0 and temperature >= MIN_TEMPERATURE:
                minp_rows.append(j)
                minp_shift.append(temperature * math.log(st.min_p))
        if new_tokens:
            pairs = host_tensor("q", new_tokens).to(self.device).view(-1, 2)
            self.counts.index_put_(
                (pairs[:, 0], pairs[:, 1]), torch.ones(len(pairs), device=self.device), accumulate=True
            )
        if self._step % EVICT_AFTER_STEPS == 0:
            self._evict()
        dev = self.device

        def flat(code: str, xs: list) -> torch.Tensor:
            return host_tensor(code, xs).to(dev, non_blocking=True)

        every = len(picked)
        masked = None
        if grammar is not None:  # NOTE: a constrained row has controls (`SamplingParams.controlled`)
            allowed = grammar.allowed()  # NOTE: first: a row whose mask is late leaves `rows` (paused)
            if grammar.rows:
                at = {i: j for j, i in enumerate(picked)}
                g_rows = [at[i] for i in grammar.rows]
                masked = (flat("q", g_rows) if len(g_rows) < every else None, allowed)
        return ControlsPlan(
            rows=flat("q", picked),
            num_rows=every,
            vocab=vocab,
            keep=(flat("q", keep_rows), flat("q", keep)) if keep_rows else None,
            ban=flat("q", ban) if ban else None,
            bias=(flat("q", bias_at), flat("f", bias)) if bias_at else None,
            penalties=Penalties(
                flat("q", pen_rows) if len(pen_rows) < every else None,
                flat("q", pen_slots),
                flat("f", pen),
                self.counts,
                self.in_prompt,
                flat("q", draft_counts) if draft_counts else None,
            )
            if pen_rows
            else None,
            min_p=(flat("q", minp_rows) if len(minp_rows) < every else None, flat("f", minp_shift))
            if minp_rows
            else None,
            grammar=masked,
        )

    def _sync(self, seq_id: int, c: RowControls, new_tokens: list[int]) -> int:
        """The slot of `seq_id`'s counts, brought up to its output so far (the token sampled since
        its last step is queued in `new_tokens`; anything else rebuilds the slot)."""
        out = c.output_ids
        n = len(out)
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.counted < n <= seq.counted + MAX_NEW_TOKENS:
            for t in out[seq.counted :]:  # one token since its last step, or a verified draft's few
                new_tokens += (seq.slot, t)
        elif seq is None or seq.counted != n:
            slot = seq.slot if seq is not None else self._allocate()
            self.counts[slot].zero_()
            self.in_prompt[slot].zero_()
            self.in_prompt[slot].index_fill_(0, host_tensor("q", c.prompt_ids).to(self.device), True)
            if out:
                ids = host_tensor("q", out).to(self.device)
                self.counts[slot].index_add_(0, ids, torch.ones(n, device=self.device))
            seq = self.seqs[seq_id] = _Seq(slot, n, self._step)
        seq.counted = n
        seq.last_step = self._step
        return seq.slot

    def forget(self, seq_ids: list[int]) -> None:
        """Sequences that ended: their slots are free for others now."""
        for k in seq_ids:
            seq = self.seqs.pop(k, None)
            if seq is not None:
                self._free.append(seq.slot)

    def _allocate(self) -> int:
        if not self._free:
            self._evict()
        if not self._free:
            old = self.counts.shape[0]
            size = max(8, 2 * old)
            self.counts = torch.cat((self.counts, torch.zeros(size - old, self.vocab_size, device=self.device)))
            self.in_prompt = torch.cat(
                (self.in_prompt, torch.zeros(size - old, self.vocab_size, dtype=torch.bool, device=self.device))
            )
            self._free = list(range(size - 1, old - 1, -1))
        return self._free.pop()

    def _evict(self) -> None:
        """Forget the sequences that have not sampled with controls for EVICT_AFTER_STEPS steps
        (ended, or waiting); one that comes back is rebuilt."""
        stale = [k for k, s in self.seqs.items() if self._step - s.last_step >= EVICT_AFTER_STEPS]
        for k in stale:
            self._free.append(self.seqs.pop(k).slot)


def _banned(bad_words: tuple[tuple[int, ...], ...], output: list[int]) -> list[int]:
    """The last token of every bad word whose other tokens end the output (vLLM: output only)."""
    banned = []
    for words in bad_words:
        k = len(words) - 1
        if k == 0 or (len(output) >= k and output[-k:] == list(words[:k])):
            banned.append(words[-1])
    return banned


@dataclass(slots=True)
class Penalties:
    """The repetition, frequency and presence penalties of one step's penalized rows."""

    rows: torch.Tensor | None  # int64[Rp] into the controlled rows; None: every controlled row
    slots: torch.Tensor  # int64[Rp]: their rows of `counts` / `in_prompt`
    values: torch.Tensor  # float32[Rp * 3]: repetition, frequency, presence
    counts: torch.Tensor  # [slots, vocab] output token counts
    in_prompt: torch.Tensor  # [slots, vocab] bool
    drafted: torch.Tensor | None = None  # flat (row, token) pairs counted on top: the draft before a verified position

    def apply(self, part: torch.Tensor) -> torch.Tensor:
        """The penalized rows' logits `[Rp, V]` after the penalties, as a new tensor."""
        pen = self.values.view(-1, 3)
        rep, freq, pres = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]  # [Rp, 1]
        counts = self.counts.index_select(0, self.slots)  # [Rp, V]
        if self.drafted is not None:
            counts.view(-1).index_add_(0, self.drafted, torch.ones(len(self.drafted), device=counts.device))
        in_output = counts > 0
        seen = self.in_prompt.index_select(0, self.slots).logical_or_(in_output)
        # repetition: divide positive logits by the penalty, multiply the others, seen tokens only
        factor = torch.where(part > 0, rep.reciprocal(), rep).masked_fill_(~seen, 1.0)
        part = part * factor
        return part.addcmul_(counts, freq, value=-1.0).addcmul_(in_output, pres, value=-1.0)


@dataclass(slots=True)
class ControlsPlan:
    """One step's controls as device tensors. Row indices below are into the controlled rows
    (`rows` holds their indices in the step's sampling rows); flat indices are row * vocab + token."""

    rows: torch.Tensor  # int64[Rc]
    num_rows: int
    vocab: int
    keep: tuple[torch.Tensor, torch.Tensor] | None  # allowed_token_ids: (its rows, flat indices to keep)
    ban: torch.Tensor | None  # flat indices to mask: bad words, stops before min_tokens
    bias: tuple[torch.Tensor, torch.Tensor] | None  # logit_bias: (flat indices, values)
    penalties: Penalties | None
    min_p: tuple[torch.Tensor | None, torch.Tensor] | None  # (rows, None: every one; log-prob shifts)
    # structured output: (its rows, None: every one; bool [Rg, V], True where the grammar allows)
    grammar: tuple[torch.Tensor | None, torch.Tensor] | None = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process the controlled rows of `logits` `[R, vocab]` in place; returns their raw logits
        `[Rc, vocab]` (float32) for the logprobs."""
        raw = logits.index_select(0, self.rows).float()  # [Rc, V]
        masks = self.keep is not None or self.ban is not None or self.grammar is not None
        z = raw.clone() if masks or self.bias is not None else raw  # raw stays unchanged
        fallback = raw  # what a row whose masks leave nothing samples from
        if self.grammar is not None:
            g_rows, allowed = self.grammar
            if g_rows is None:
                z.masked_fill_(~allowed, _NEG_INF)
            else:
                z[g_rows] = z[g_rows].masked_fill_(~allowed, _NEG_INF)
            fallback = z.clone() if self.keep is not None or self.ban is not None else z
        if self.keep is not None:
            keep_rows, keep_at = self.keep
            keep = torch.ones_like(z, dtype=torch.bool)
            keep[keep_rows] = False
            keep.view(-1)[keep_at] = True
            z.masked_fill_(~keep, _NEG_INF)
            if self.grammar is None:  # NOTE: with a grammar, the fallback is the grammar's tokens
                fallback = z.clone()
        if self.ban is not None:
            z.view(-1)[self.ban] = _NEG_INF
        if self.bias is not None:
            bias_at, bias = self.bias
            z.view(-1).index_add_(0, bias_at, bias)
        if self.penalties is not None:
            z = self._rows_replaced(z, raw, self.penalties.rows, self.penalties.apply)
        if self.min_p is not None:
            minp_rows, shift = self.min_p
            z = self._rows_replaced(z, raw, minp_rows, lambda part: _min_p(part, shift))
        if masks:
            # NOTE: the API and the Submit check refuse controls that could mask every token
            # (`rules.constraints_error`); should a row still have none left, it samples from its
            # allowed tokens alone (from its raw logits without such a set), never outside them,
            # nor outside its grammar (which always allows a token: EOS once it is complete).
            z = torch.where(torch.isneginf(z.amax(-1, keepdim=True)), fallback, z)
        logits.index_copy_(0, self.rows, z.to(logits.dtype))
        return raw

    @staticmethod
    def _rows_replaced(z: torch.Tensor, raw: torch.Tensor, rows: torch.Tensor | None, fn) -> torch.Tensor:
        """`z` with `fn` applied to its `rows` (None: all of them); never changes `raw`."""
        if rows is None:
            return fn(z)
        if z is raw:
            z = raw.clone()
        z[rows] = fn(z[rows])
        return z

    def report_raw(self, raw: torch.Tensor, out: SampleOutput, sampling) -> None:
        """Replace the logprobs in `out` of the controlled rows that asked for logprobs with their
        raw distribution's (the others' logprob is the sampler's; a request that did not ask
        shows none)."""
        rows = self.rows.tolist()
        asked = [j for j, i in enumerate(rows) if sampling[i].logprobs is not None]
        if not asked:
            return
        if len(asked) < len(rows):
            raw = raw[asked]
            rows = [rows[j] for j in asked]
        tokens = host_tensor("q", [out.token_ids[i] for i in rows]).to(raw.device)
        lse = torch.logsumexp(raw, dim=-1)  # [Ra]
        lp = (raw.gather(1, tokens[:, None]).squeeze(1) - lse).tolist()
        top_n = [sampling[i].logprobs for i in rows]
        most = max(n or 0 for n in top_n)
        top_ids: list[list[int]] = []
        top_lp: list[list[float]] = []
        if most:
            vals, ids = torch.topk(raw, min(most, raw.shape[-1]), dim=-1)
            top_ids, top_lp = ids.tolist(), (vals - lse[:, None]).tolist()
        for j, i in enumerate(rows):
            out.logprobs[i] = lp[j]
            n = top_n[j]
            if n:
                out.top_logprobs[i] = list(zip(top_ids[j][:n], top_lp[j][:n]))


def _min_p(part: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """Tokens below min_p x the top probability at the row's temperature, masked (new tensor);
    `shift` `[Rm]` is log(min_p) x the row's temperature."""
    cut = part.amax(-1, keepdim=True) + shift[:, None]
    return part.masked_fill(part < cut, _NEG_INF)


def row_settings(rows: list[SeqStep]) -> list[RowSampling]:
    """The sampling settings of a step's sampling rows (every one has them)."""
    sampling = [s.sampling for s in rows if s.sampling is not None]
    if len(sampling) != len(rows):
        raise ValueError("a row without sampling settings was given to the sampler")
    return sampling
