"""vLLM's logits controls on the sampling rows' logits, before the sampler (`docs/design.md#sampling`).

Rows whose `RowSampling.controls` is set (the request asked for a non-neutral control) are
processed; the others are not touched, and a step without such rows does no work here at all.
The order is vLLM's: `allowed_token_ids`, `bad_words`, `min_tokens` (mask the stop tokens and EOS
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
They live on the device, one row of a slab per sequence (by seq id), updated with the one token a
sequence sampled since its last step; a row whose count does not match its output (it was evicted
after a long wait, or is new) is rebuilt from the request's token lists, which the scheduler owns
(`RowControls` holds them by reference). Slots unused for `EVICT_AFTER_STEPS` steps are reused.
Bad-word prefixes are matched on the host against each row's last output tokens (bounded by
`shm.messages.MAX_BAD_WORDS` words of `MAX_BAD_WORD_TOKENS` tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention.metadata import host_tensor
from .sampler import MIN_TEMPERATURE, SampleOutput, sample
from .step import RowControls, SeqStep

EVICT_AFTER_STEPS = 256
_NEG_INF = float("-inf")


@dataclass(slots=True)
class _Seq:
    slot: int
    counted: int  # output tokens included in the slot's counts
    last_step: int


class ControlsState:
    """The engine's side of the logits controls: per-sequence device state, and `sample`."""

    def __init__(self, vocab_size: int, eos_token_ids, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.eos = tuple(sorted(eos_token_ids))
        self.device = device
        self.counts = torch.zeros(0, vocab_size, device=device)  # [slots, vocab] output counts
        self.in_prompt = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)  # [slots, vocab]
        self.seqs: dict[int, _Seq] = {}
        self._free: list[int] = []
        self._step = 0

    def sample(self, logits: torch.Tensor, rows: list[SeqStep]) -> SampleOutput:
        """Sample the step's sampling rows (`logits` `[R, vocab]`, modified in place for the rows
        with controls), as `sampler.sample` does."""
        sampling = [s.sampling for s in rows]
        positions = [s.context_len for s in rows]
        if all(r.controls is None for r in sampling):
            return sample(logits, sampling, positions)  # the common case: nothing more at all
        with torch.inference_mode():  # the runner's logits are inference tensors
            plan = self.plan(rows)
            raw = plan.apply(logits)
            out = sample(logits, sampling, positions)
            plan.report_raw(raw, out, sampling)
        return out

    # -- the plan (host) --------------------------------------------------------------------------

    def plan(self, rows: list[SeqStep]) -> ControlsPlan | None:
        """The step's controls as a few device tensors; None when no row has any."""
        picked = [i for i, s in enumerate(rows) if s.sampling.controls is not None]
        if not picked:
            return None
        self._step += 1
        controls = [rows[i].sampling.controls for i in picked]
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
        for j, c in enumerate(controls):
            st = c.settings
            base = j * vocab
            if st.allowed_token_ids:
                keep_rows.append(j)
                keep += [base + t for t in st.allowed_token_ids]
            if st.bad_words:
                ban += [base + t for t in _banned(st.bad_words, c.output_ids)]
            if len(c.output_ids) < st.min_tokens:
                ban += [base + t for t in st.stop_token_ids + self.eos if t < vocab]
            if st.logit_bias:
                bias_at += [base + t for t, _ in st.logit_bias]
                bias += [b for _, b in st.logit_bias]
            if st.penalized:
                pen_rows.append(j)
                pen_slots.append(self._sync(rows[picked[j]].seq_id, c, new_tokens))
                pen += (st.repetition_penalty, st.frequency_penalty, st.presence_penalty)
            temperature = rows[picked[j]].sampling.temperature
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
        flat = lambda code, xs: host_tensor(code, xs).to(dev, non_blocking=True) if xs else None  # noqa: E731
        return ControlsPlan(
            rows=host_tensor("q", picked).to(dev, non_blocking=True),
            num_rows=len(picked),
            vocab=vocab,
            keep_rows=flat("q", keep_rows),
            keep=flat("q", keep),
            ban=flat("q", ban),
            bias_at=flat("q", bias_at),
            bias=flat("f", bias),
            pen_rows=flat("q", pen_rows) if len(pen_rows) < len(picked) else None,
            pen_slots=flat("q", pen_slots),
            pen=flat("f", pen),
            counts=self.counts,
            in_prompt=self.in_prompt,
            minp_rows=flat("q", minp_rows) if len(minp_rows) < len(picked) else None,
            minp_shift=flat("f", minp_shift),
        )

    def _sync(self, seq_id: int, c: RowControls, new_tokens: list[int]) -> int:
        """The slot of `seq_id`'s counts, brought up to its output so far (the token sampled since
        its last step is queued in `new_tokens`; anything else rebuilds the slot)."""
        out = c.output_ids
        n = len(out)
        seq = self.seqs.get(seq_id)
        if seq is not None and seq.counted == n - 1:
            new_tokens += (seq.slot, out[-1])
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
class ControlsPlan:
    """One step's controls as device tensors. Row indices below are into the controlled rows
    (`rows` holds their indices in the step's sampling rows); flat indices are row * vocab + token.
    `pen_rows` / `minp_rows` None: every controlled row."""

    rows: torch.Tensor  # int64[Rc]
    num_rows: int
    vocab: int
    keep_rows: torch.Tensor | None
    keep: torch.Tensor | None
    ban: torch.Tensor | None
    bias_at: torch.Tensor | None
    bias: torch.Tensor | None
    pen_rows: torch.Tensor | None
    pen_slots: torch.Tensor | None
    pen: torch.Tensor | None  # float32[Rp * 3]: repetition, frequency, presence
    counts: torch.Tensor
    in_prompt: torch.Tensor
    minp_rows: torch.Tensor | None
    minp_shift: torch.Tensor | None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """Process the controlled rows of `logits` `[R, vocab]` in place; returns their raw logits
        `[Rc, vocab]` (float32) for the logprobs."""
        raw = logits.index_select(0, self.rows).float()  # [Rc, V]
        masks = self.keep is not None or self.ban is not None
        z = raw.clone() if masks or self.bias is not None else raw  # raw stays unchanged
        if self.keep is not None:
            keep = torch.ones_like(z, dtype=torch.bool)
            keep[self.keep_rows] = False
            keep.view(-1)[self.keep] = True
            z.masked_fill_(~keep, _NEG_INF)
        if self.ban is not None:
            z.view(-1)[self.ban] = _NEG_INF
        if self.bias is not None:
            z.view(-1).index_add_(0, self.bias_at, self.bias)
        if self.pen_slots is not None:
            z = self._rows_replaced(z, raw, self.pen_rows, self._penalize)
        if self.minp_shift is not None:
            z = self._rows_replaced(z, raw, self.minp_rows, self._min_p)
        if masks:
            # NOTE: a row whose controls mask every token (allowed ids all banned) samples from
            # its raw logits rather than from nothing; only masks can do that (min_p keeps the top).
            z = torch.where(torch.isneginf(z.amax(-1, keepdim=True)), raw, z)
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

    def _penalize(self, part: torch.Tensor) -> torch.Tensor:
        """The penalized rows' logits `[Rp, V]` after the penalties, as a new tensor."""
        pen = self.pen.view(-1, 3)
        rep, freq, pres = pen[:, 0:1], pen[:, 1:2], pen[:, 2:3]  # [Rp, 1]
        counts = self.counts.index_select(0, self.pen_slots)  # [Rp, V]
        in_output = counts > 0
        seen = self.in_prompt.index_select(0, self.pen_slots).logical_or_(in_output)
        # repetition: divide positive logits by the penalty, multiply the others, seen tokens only
        factor = torch.where(part > 0, rep.reciprocal(), rep).masked_fill_(~seen, 1.0)
        part = part * factor
        return part.addcmul_(counts, freq, value=-1.0).addcmul_(in_output, pres, value=-1.0)

    def _min_p(self, part: torch.Tensor) -> torch.Tensor:
        """Tokens below min_p x the top probability at the row's temperature, masked (new tensor)."""
        cut = part.amax(-1, keepdim=True) + self.minp_shift[:, None]
        return part.masked_fill(part < cut, _NEG_INF)

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
        tops = None
        if max(top_n):
            vals, ids = torch.topk(raw, min(max(top_n), raw.shape[-1]), dim=-1)
            tops = (ids.tolist(), (vals - lse[:, None]).tolist())
        for j, i in enumerate(rows):
            out.logprobs[i] = lp[j]
            if top_n[j]:
                out.top_logprobs[i] = list(zip(tops[0][j][: top_n[j]], tops[1][j][: top_n[j]]))
