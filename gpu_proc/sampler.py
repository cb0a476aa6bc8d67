"""Seeded sampling over a batch of logits: greedy, temperature, top-k, top-p, logprobs.

Randomness. Each row draws exactly one uniform `u` in [0, 1), a pure function of
(seed, sample_index, position) through a splitmix64 hash, and picks its token by inverse CDF: the
first token (in a fixed order) whose cumulative probability exceeds `u * total`. There is no
generator object at all, so a request's tokens depend neither on its batch neighbours, nor on being
preempted and recomputed, nor on a GPU-process restart.

Filtering. Top-k keeps the k most probable tokens; top-p then keeps the smallest prefix (by
descending probability) of what remains whose mass reaches `top_p` of it (top-k first, then top-p
on the renormalised top-k distribution, as transformers does). Neither needs a full-vocabulary sort:
rows take `topk` candidates (k, or `_TOP_P_CANDIDATES` for top-p alone) and a top-p row whose
candidates do not cover `top_p` of the mass — a very flat distribution — is redone with a full sort,
alone. Rows without filters sample in vocabulary order straight from one cumulative sum.

Logprobs are those of the model's raw distribution (`log_softmax` of the logits, before temperature
and filters), as OpenAI-compatible servers report them.

The work is split so a benchmark can time it: `plan_sampling` (host: per-row parameters into a few
tensors), `sample_tensors` (device math, vectorised over rows), `to_output` (host: one transfer back
and the Python lists).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(slots=True)
class SampleOutput:
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]] | None]


@dataclass(slots=True)
class SamplingPlan:
    """Per-row sampling parameters as device tensors, grouped by how each row samples."""

    num_rows: int
    random_rows: torch.Tensor | None  # int64[Rr]: rows with temperature > 0
    temperature: torch.Tensor | None  # float32[Rr]
    uniform: torch.Tensor | None  # float32[Rr]
    top_k: torch.Tensor | None  # int64[Rr], 0 = off
    top_p: torch.Tensor | None  # float32[Rr]
    any_filter: bool
    top_n: list[int | None]  # per row: how many top logprobs to return
    max_top_n: int


def plan_sampling(rows: list[RowSampling], positions: list[int], device: torch.device) -> SamplingPlan:
    """Host half: gather the rows' parameters into a few tensors (one copy each)."""
    if len(rows) != len(positions):
        raise ValueError(f"{len(rows)} sampling rows but {len(positions)} positions")
    rand = [i for i, r in enumerate(rows) if r.temperature > 0.0]
    top_n = [r.logprobs for r in rows]
    max_top_n = max((n for n in top_n if n), default=0)
    if not rand:
        return SamplingPlan(len(rows), None, None, None, None, None, False, top_n, max_top_n)
    floats = torch.tensor(
        [rows[i].temperature for i in rand] + [min(rows[i].top_p, 1.0) for i in rand]
        + [row_uniform(rows[i].seed, rows[i].sample_index, positions[i]) for i in rand],
        dtype=torch.float32).to(device, non_blocking=True)
    ints = torch.tensor(rand + [max(rows[i].top_k, 0) for i in rand], dtype=torch.int64).to(device, non_blocking=True)
    n = len(rand)
    any_filter = any(rows[i].top_k > 0 or rows[i].top_p < 1.0 for i in rand)
    return SamplingPlan(len(rows), ints[:n], floats[:n], floats[2 * n:], ints[n:], floats[n:2 * n],
                        any_filter, top_n, max_top_n)


def _inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index of the first column whose running sum exceeds u * row total; zero-weight columns are
    never chosen. weights `[n, m]`, u `[n]` -> int64 `[n]`."""
    cdf = torch.cumsum(weights, dim=-1)  # [n, m]
    target = (u * cdf[:, -1]).unsqueeze(-1)  # [n, 1]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    return idx.clamp_(max=weights.shape[-1] - 1)


def _filtered_pick(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
                   num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
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


def sample_tensors(logits: torch.Tensor, plan: SamplingPlan
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Device half: (token ids `[R]`, their logprobs `[R]`, top-N ids `[R, N]`, top-N logprobs)."""
    if logits.dim() != 2 or logits.shape[0] != plan.num_rows:
        raise ValueError(f"logits {tuple(logits.shape)} do not match {plan.num_rows} sampling rows")
    logits = logits.float()
    tokens = logits.argmax(dim=-1)  # greedy rows keep this
    if plan.random_rows is not None:
        z = logits.index_select(0, plan.random_rows) / plan.temperature[:, None]  # [Rr, V]
        probs = torch.softmax(z, dim=-1)
        if plan.any_filter:
            vocab = probs.shape[-1]
            c = min(vocab, max(_TOP_P_CANDIDATES, int(plan.top_k.max())))
            picked, covered = _filtered_pick(probs, plan.top_k, plan.top_p, plan.uniform, c)
            unfiltered = (plan.top_k == 0) & (plan.top_p >= 1.0)
            if bool(unfiltered.any()):
                picked = torch.where(unfiltered, _inverse_cdf(probs, plan.uniform), picked)
            redo = ~covered & ~unfiltered
            if bool(redo.any()):  # flat distributions only: a full sort for those rows alone
                r = redo.nonzero().squeeze(1)
                full, _ = _filtered_pick(probs[r], plan.top_k[r], plan.top_p[r], plan.uniform[r], vocab)
                picked = picked.index_put((r,), full)
        else:
            picked = _inverse_cdf(probs, plan.uniform)
        tokens = tokens.index_put((plan.random_rows,), picked)
    lse = torch.logsumexp(logits, dim=-1)  # [R]
    logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - lse
    top_ids = top_lp = None
    if plan.max_top_n:
        top_vals, top_ids = torch.topk(logits, min(plan.max_top_n, logits.shape[-1]), dim=-1)  # [R, N]
        top_lp = top_vals - lse[:, None]
    return tokens, logprobs, top_ids, top_lp


def to_output(plan: SamplingPlan, tokens: torch.Tensor, logprobs: torch.Tensor,
              top_ids: torch.Tensor | None, top_lp: torch.Tensor | None) -> SampleOutput:
    """Host half: one device-to-host transfer, then plain Python lists."""
    # float64 holds every token id exactly, so ids and logprobs travel as one tensor.
    packed = torch.stack((tokens.double(), logprobs.double())).tolist()
    token_ids = [int(t) for t in packed[0]]
    tops: list[list[tuple[int, float]] | None] = [None] * plan.num_rows
    if top_ids is not None:
        ids_l, lp_l = top_ids.tolist(), top_lp.tolist()
        for i, n in enumerate(plan.top_n):
            if n:
                tops[i] = list(zip(ids_l[i][:n], lp_l[i][:n]))
    return SampleOutput(token_ids=token_ids, logprobs=packed[1], top_logprobs=tops)


def sample(logits: torch.Tensor, rows: list[RowSampling], positions: list[int]) -> SampleOutput:
    """Sample one token per row. `positions[i]` is the position of the token being produced
    (the row's context length); with the seed and sample index it fixes the row's randomness."""
    plan = plan_sampling(rows, positions, logits.device)
    return to_output(plan, *sample_tensors(logits, plan))
