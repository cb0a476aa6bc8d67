"""Seeded sampling over a batch of logits: greedy, temperature, top-k, top-p, logprobs.

Randomness. Each row draws exactly one uniform `u` in [0, 1), a pure function of
(seed, sample_index, position) through a splitmix64 hash, and picks its token by inverse CDF: the
first token (in a fixed order) whose cumulative probability exceeds `u * total`. There is no
generator object at all, so a request's tokens depend neither on its batch neighbours, nor on being
preempted and recomputed, nor on a GPU-process restart.

The hash runs on the device over the batch's (seed, index, position) tensors; `row_uniform` is
the same function in Python, the specification the tensor version is tested against.

Filtering. Top-k keeps the k most probable tokens; top-p then keeps the smallest prefix (by
descending probability) of what remains whose mass reaches `top_p` of it (top-k first, then top-p
on the renormalised top-k distribution, as transformers does). Neither needs a full-vocabulary sort:
rows take `topk` candidates (k, or `_TOP_P_CANDIDATES` for top-p alone). A top-p row whose
candidates do not cover `top_p` of the mass (a flat distribution) is redone exactly with just enough
candidates: a probability-weighted histogram of log-probabilities (one pass) bounds how many tokens
the nucleus can hold, and `topk` of that many replaces a full sort. Rows without filters sample in
vocabulary order straight from one cumulative sum.

Logprobs are those of the model's raw distribution (`log_softmax` of the logits, before temperature
and filters), as OpenAI-compatible servers report them. A row whose request did not ask for them
(`logprobs` None) gets NaN (the API sends null), and a batch where no row asked skips the
log-sum-exp over the vocabulary altogether: at a 49k vocabulary it cost as much as the argmax.

The work is split so a benchmark can time it: `plan_sampling` (host: per-row parameters into a few
tensors), `sample_tensors` (device math, vectorised over rows), `to_output` (host: one transfer back
and the Python lists).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import cpu_ops
from .host_tensor import host_tensor
from .step import RowSampling

_MASK64 = (1 << 64) - 1
_TOP_P_CANDIDATES = 128


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_uniform(seed: int, sample_index: int, position: int) -> float:
    """The row's one uniform in [0, 1): 24 hash bits, so it is exact in float32 and never 1.0."""
    h = _splitmix64(_splitmix64(_splitmix64(seed & _MASK64) ^ (sample_index & _MASK64)) ^ (position & _MASK64))
    return (h >> 40) / float(1 << 24)


def _signed64(x: int) -> int:
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _srl(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _splitmix64_t(x: torch.Tensor) -> torch.Tensor:
    # NOTE: int64 tensor arithmetic wraps modulo 2**64 on CPU and CUDA, which is exactly the
    # unsigned arithmetic splitmix64 needs; XOR and masks act on the same bit patterns.
    x = x + _signed64(0x9E3779B97F4A7C15)
    x = (x ^ _srl(x, 30)) * _signed64(0xBF58476D1CE4E5B9)
    x = (x ^ _srl(x, 27)) * _signed64(0x94D049BB133111EB)
    return x ^ _srl(x, 31)


def uniforms(seed: torch.Tensor, sample_index: torch.Tensor, position: torch.Tensor) -> torch.Tensor:
    """`row_uniform` over int64 tensors, on their device: float32 `[n]`."""
    h = _splitmix64_t(_splitmix64_t(_splitmix64_t(seed) ^ sample_index) ^ position)
    return _srl(h, 40).float() * (1.0 / (1 << 24))


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]
    prompt_logprobs: list | None = None  # set by the engine (`prompt_logprobs.score`), not here
    pooled: list[bytes] | None = None  # set by the engine (`pooling.sums`), not here
    # sequences whose samples are void: a grammar mask was not ready (`grammar.py`); the scheduler
    # emits nothing for them and computes their last token again
    paused: frozenset[int] = frozenset()


@dataclass(slots=True)
class RandomRows:
    """The rows that draw a random token (temperature > 0), as device tensors."""

    rows: torch.Tensor  # int64[Rr]: their indices among the sampling rows
    temperature: torch.Tensor  # float32[Rr]
    hash_inputs: torch.Tensor  # int64[3, Rr]: seed (as signed 64-bit), sample index, position
    top_k: torch.Tensor  # int64[Rr], 0 = off
    top_p: torch.Tensor  # float32[Rr]
    filtered: torch.Tensor | None  # int64[Rf]: indices into the random rows that use top-k/top-p
    unfiltered: torch.Tensor | None  # int64[Ru]: the other random rows
    max_top_k: int  # known on the host, so choosing the candidate count needs no device sync


@dataclass(slots=True)
class SamplingPlan:
    """Per-row sampling parameters as device tensors, grouped by how each row samples."""

    num_rows: int
    random: RandomRows | None  # None: every row is greedy
    top_n: list[int | None]  # per row: how many top logprobs to return; None: no logprob at all
    max_top_n: int


# Below this a temperature is greedy: dividing logits by a denormal gives inf, and softmax NaN.
MIN_TEMPERATURE = 1e-5


def plan_sampling(rows: list[RowSampling], positions: list[int], device: torch.device) -> SamplingPlan:
    """Host half: gather the rows' parameters into a few tensors (one copy each)."""
    if len(rows) != len(positions):
        raise ValueError(f"{len(rows)} sampling rows but {len(positions)} positions")
    rand = [i for i, r in enumerate(rows) if r.temperature >= MIN_TEMPERATURE]
    top_n = [r.logprobs for r in rows]
    max_top_n = max(filter(None, top_n), default=0)
    if not rand:
        return SamplingPlan(len(rows), None, top_n, max_top_n)
    sel = rows if len(rand) == len(rows) else [rows[i] for i in rand]
    pos = positions if sel is rows else [positions[i] for i in rand]
    seeds = [r.seed for r in sel]
    if min(seeds) < 0 or max(seeds) >= 1 << 63:  # rare: reinterpret as the int64 bit pattern
        seeds = [_signed64(x) for x in seeds]
    # top_p and top_k are clamped on the device: per-row min/max calls cost more than the rest here.
    floats = host_tensor("f", [r.temperature for r in sel] + [r.top_p for r in sel]).to(device, non_blocking=True)
    filters = [r.top_k > 0 or r.top_p < 1.0 for r in sel]
    filt = [j for j, f in enumerate(filters) if f]
    unf = [j for j, f in enumerate(filters) if not f]
    top_k = [r.top_k for r in sel]
    ints = host_tensor("q", rand + top_k + seeds + [r.sample_index for r in sel] + pos + filt + unf).to(
        device, non_blocking=True
    )
    n, nf = len(rand), len(filt)
    random = RandomRows(
        rows=ints[:n],
        temperature=floats[:n],
        hash_inputs=ints[2 * n : 5 * n].view(3, n),
        top_k=ints[n : 2 * n].clamp(min=0),
        top_p=floats[n:].clamp(max=1.0),
        filtered=ints[5 * n : 5 * n + nf] if filt else None,
        unfiltered=ints[5 * n + nf :] if unf else None,
        max_top_k=max(top_k),
    )
    return SamplingPlan(len(rows), random, top_n, max_top_n)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first column whose running sum exceeds u * row total; zero-weight columns are
    never chosen. weights `[n, m]`, u `[n]` -> int64 `[n]`."""
    cdf = torch.cumsum(weights, dim=-1)  # [n, m]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=weights.shape[-1] - 1)


def _filtered_pick(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p over the `num_candidates` most probable tokens of each row.

    Returns (token ids `[n]`, covered `[n]` bool): a row is not covered when it has no top-k and
    its candidates hold less than `top_p` of the mass, so its top-p set may extend past them.
    """
    vocab = probs.shape[-1]
    vals, ids = torch.topk(probs, num_candidates, dim=-1)  # [n, c], descending
    rank = torch.arange(num_candidates, device=probs.device)
    k_eff = torch.where(top_k > 0, top_k.clamp(max=vocab), num_candidates)  # [n]
    in_k = rank[None, :] < k_eff[:, None]  # [n, c]
    vals = vals * in_k
    # Top-p is measured against the top-k mass when top-k is on, else against the whole row.
    mass = torch.where(top_k > 0, vals.sum(-1), probs.sum(-1))  # [n]
    before = torch.cumsum(vals, dim=-1) - vals  # mass strictly ahead of each candidate
    # Keep a candidate while the mass ahead of it is below top_p of that mass: the smallest prefix
    # reaching top_p. The first candidate is always kept.
    keep = in_k & ((before < (top_p * mass)[:, None]) | (rank[None, :] == 0))
    covered = (top_k > 0) | (vals.sum(-1) >= top_p * mass) | (num_candidates >= vocab)
    pick = _inverse_cdf(vals * keep, u)
    return ids.gather(1, pick[:, None]).squeeze(1), covered


_BIN_WIDTH = 0.125  # nats per histogram bin
_NUM_BINS = 128  # bins cover 16 nats below the top token; the rest share the last bin


def _nucleus_bound(probs: torch.Tensor, top_p: torch.Tensor) -> int:
    """An upper bound on the largest top-p set among the rows of probs `[n, V]`.

    Tokens fall into bins by how far their log-probability is below the row's best; bins are
    ordered by probability, so the nucleus lies within the bins up to the one where the cumulative
    mass reaches `top_p` (one more bin is added against rounding in the sums).
    """
    n, vocab = probs.shape
    logp = probs.clamp_min(1e-38).log()
    # clamped both ways: a NaN distance (a row of NaN logits) casts to the most negative integer
    bins = ((logp.max(-1, keepdim=True).values - logp) * (1.0 / _BIN_WIDTH)).long().clamp_(0, _NUM_BINS - 1)
    mass = torch.zeros(n, _NUM_BINS, device=probs.device).scatter_add_(1, bins, probs)
    count = torch.zeros(n, _NUM_BINS, device=probs.device).scatter_add_(1, bins, torch.ones_like(probs))
    cum = mass.cumsum(1)  # [n, bins]
    last = torch.searchsorted(cum, (top_p * cum[:, -1])[:, None]).add_(1).clamp_(max=_NUM_BINS - 1)
    return min(vocab, int(count.cumsum(1).gather(1, last).max()))


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    if logits.device.type == "cpu" and cpu_ops.kernels_loaded():
        return cpu_ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def sample_tensors(
    logits: torch.Tensor, plan: SamplingPlan
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Device half: (`[2, R]` float64 of token ids and their logprobs — `[1, R]`, ids only, when no
    row wants logprobs — top-N ids `[R, N]`, top-N logprobs `[R, N]`). float64 holds every token id
    exactly, so ids and logprobs leave the device as one tensor."""
    if logits.dim() != 2 or logits.shape[0] != plan.num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {plan.num_rows} sampling rows")
    logits = logits.float()
    # Each pass over [rows, vocab] costs about as much as the whole host side at 256 rows, so
    # subsets are only cut out (copied) when a batch really mixes kinds of rows.
    rnd = plan.random
    if rnd is None:
        tokens = _argmax(logits)
    elif rnd.rows.shape[0] == plan.num_rows:  # every row draws: no greedy pass at all
        tokens = _pick_random(logits, rnd, all_rows=True)
    else:  # greedy rows keep the argmax
        tokens = _argmax(logits).index_put((rnd.rows,), _pick_random(logits, rnd, all_rows=False))
    if all(n is None for n in plan.top_n):  # nobody asked: no pass over the vocabulary for them
        return tokens.double()[None, :], None, None
    lse = torch.logsumexp(logits, dim=-1)  # [R]
    logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    top_ids = top_lp = None
    if plan.max_top_n:
        top_vals, top_ids = torch.topk(logits, min(plan.max_top_n, logits.shape[-1]), dim=-1)  # [R, N]
        top_lp = top_vals - lse[:, None]
    return torch.stack((tokens.double(), logprobs.double())), top_ids, top_lp


def _pick_random(logits: torch.Tensor, rnd: RandomRows, all_rows: bool) -> torch.Tensor:
    """The tokens of the random rows (`[Rr]`): temperature, then top-k/top-p where asked, then the
    row's own uniform through the inverse CDF."""
    if all_rows:
        z = logits / rnd.temperature[:, None]  # [Rr, V]
    else:
        z = logits.index_select(0, rnd.rows).div_(rnd.temperature[:, None])
    probs = torch.softmax(z, dim=-1)
    del z
    u = uniforms(rnd.hash_inputs[0], rnd.hash_inputs[1], rnd.hash_inputs[2])  # [Rr]
    picked = torch.empty_like(rnd.rows)
    if rnd.unfiltered is not None:
        ru = rnd.unfiltered
        if rnd.filtered is None:
            picked = _inverse_cdf(probs, u)
        else:
            picked[ru] = _inverse_cdf(probs[ru], u[ru])
    if rnd.filtered is not None:
        rf = rnd.filtered
        if rnd.unfiltered is None:
            pf, top_k, top_p, uf = probs, rnd.top_k, rnd.top_p, u
        else:
            pf, top_k, top_p, uf = probs[rf], rnd.top_k[rf], rnd.top_p[rf], u[rf]
        vocab = probs.shape[-1]
        c = min(vocab, max(_TOP_P_CANDIDATES, rnd.max_top_k))
        chosen, covered = _filtered_pick(pf, top_k, top_p, uf, c)
        if not bool(covered.all()):  # flat distributions: those rows again, with enough candidates
            r = (~covered).nonzero().squeeze(1)
            wide = max(c, _nucleus_bound(pf[r], top_p[r]))
            again, _ = _filtered_pick(pf[r], top_k[r], top_p[r], uf[r], wide)
            chosen = chosen.index_put((r,), again)
        if rnd.unfiltered is None:
            picked = chosen
        else:
            picked[rf] = chosen
    return picked


def to_output(
    plan: SamplingPlan, packed: torch.Tensor, top_ids: torch.Tensor | None, top_lp: torch.Tensor | None
) -> SampleOutput:
    """Host half: one device-to-host transfer, then plain Python lists."""
    packed_l = packed.tolist()
    token_ids = list(map(int, packed_l[0]))
    if len(packed_l) == 1:
        logprobs = [math.nan] * plan.num_rows
    else:
        logprobs = [lp if n is not None else math.nan for lp, n in zip(packed_l[1], plan.top_n)]
    tops: list[list[tuple[int, float]] | None] = [None] * plan.num_rows
    if top_ids is not None and top_lp is not None:
        ids_l, lp_l = top_ids.tolist(), top_lp.tolist()
        for i, n in enumerate(plan.top_n):
            if n:
                tops[i] = list(zip(ids_l[i][:n], lp_l[i][:n]))
    return SampleOutput(token_ids=token_ids, logprobs=logprobs, top_logprobs=tops)


def sample(logits: torch.Tensor, rows: list[RowSampling], positions: list[int]) -> SampleOutput:
    """Sample one token per row. `positions[i]` is the position of the token being produced
    (the row's context length); with the seed and sample index it fixes the row's randomness."""
    plan = plan_sampling(rows, positions, logits.device)
    return to_output(plan, *sample_tensors(logits, plan))
