"""Replay a trace through a batching policy on a virtual clock, with measured or modelled step times.

The driver (`replay`) owns time. Requests arrive at their trace offsets; each pass asks the policy
for a step, runs it on an executor, and advances the clock by the step's cost:

- `EngineExecutor` runs the real model runner and sampler (CPU or CUDA) and charges the measured
  wall time of the whole pass — scheduling, forward, sampling and bookkeeping;
- `SimExecutor` charges a `StepCost` model: `step_ms = a + b * rows + c * prefill_tokens`, where
  `rows` counts the sequences in the step (decode rows and prefill chunks alike) — the weights are
  read once per step (a), each row adds attention and sampling work (b), each prompt token adds its
  share of the dense layers (c).

An idle policy jumps the clock to the next arrival (or its own batching window), so a replay takes
the time of its steps, not of the trace. `StepCost.fit` fits (a, b, c) by least squares to the
(rows, prefill tokens, ms) samples an engine replay records, so the simulator can be checked
against the engine on the same trace and then run at sizes the machine cannot. `DESIGN_7B_A100` is
the design's paper model (docs/design.md#sizing): 25 ms at 1 row, 40 ms at 32 rows, 0.1 ms per prompt token.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from ringserve.tools.harness.trace import TraceRequest


@dataclass(frozen=True, slots=True)
class StepCost:
    """Step time model: `a_ms + b_ms * rows + c_ms * prefill_tokens`."""

    a_ms: float
    b_ms: float
    c_ms: float

    def ms(self, rows: int, prefill_tokens: int) -> float:
        return self.a_ms + self.b_ms * rows + self.c_ms * prefill_tokens

    @classmethod
    def fit(cls, samples: list[tuple[int, int, float]]) -> StepCost:
        """Least squares over `(rows, prefill_tokens, ms)` samples (needs 3 that are not collinear)."""
        import numpy as np

        if len(samples) < 3:
            raise ValueError(f"need at least 3 step samples to fit 3 coefficients, got {len(samples)}")
        x = np.array([[1.0, r, p] for r, p, _ in samples])  # [steps, 3]
        y = np.array([ms for _, _, ms in samples])  # [steps]
        if np.linalg.matrix_rank(x) < 3:
            raise ValueError("step samples do not vary both rows and prefill tokens; cannot fit the model")
        coef, *_ = np.linalg.lstsq(x, y, rcond=None)
        return cls(*(float(c) for c in coef))

    def r_squared(self, samples: list[tuple[int, int, float]]) -> float:
        ys = [ms for _, _, ms in samples]
        mean = sum(ys) / len(ys)
        ss_tot = sum((y - mean) ** 2 for y in ys)
        ss_res = sum((ms - self.ms(r, p)) ** 2 for r, p, ms in samples)
        return 1.0 - ss_res / ss_tot if ss_tot else 1.0

    def describe(self) -> str:
        return f"step_ms = {self.a_ms:.3f} + {self.b_ms:.4f} * rows + {self.c_ms:.5f} * prefill_tokens"


DESIGN_7B_A100 = StepCost(25.0 - 15.0 / 31.0, 15.0 / 31.0, 0.1)  # 25 ms @ 1 row, 40 ms @ 32, 0.1 ms/token


@dataclass(frozen=True, slots=True)
class _Samples:
    """The sampler's output shape, for a simulated step."""

    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[None]


class SimExecutor:
    """Charges the cost model; every sampled token is `token_id` (EOS is ignored by the policies)."""

    measures_host = False

    def __init__(self, cost: StepCost, token_id: int = 3) -> None:
        self.cost = cost
        self.token_id = token_id

    def run(self, batch, prefill_tokens: int) -> tuple[_Samples, float]:
        n = len(batch.sampling_seqs)
        out = _Samples([self.token_id] * n, [0.0] * n, [None] * n)
        return out, self.cost.ms(len(batch.seqs), prefill_tokens)


class EngineExecutor:
    """Runs the real engine (`gpu_proc.executor.Executor`); the driver charges the pass's wall time."""

    measures_host = True

    def __init__(self, engine) -> None:
        self.engine = engine

    def run(self, batch, prefill_tokens: int):
        return self.engine.step(batch), 0.0


@dataclass(slots=True)
class _Timing:
    arrival: float
    want: int
    first: float = 0.0  # these three are set with the first token / the finish; the replay checks
    last: float = 0.0  # that every request got all its tokens before reading them
    tokens: int = 0
    max_gap: float = 0.0
    done: float = 0.0


@dataclass(slots=True)
class ReplayResult:
    """One replay: per-request times (seconds on the virtual clock) and per-step samples."""

    name: str
    ttft_s: list[float]
    tpot_s: list[float]  # requests with >= 2 tokens
    max_gap_s: list[float]
    output_tokens: int
    makespan_s: float
    steps: int
    preemptions: int
    step_samples: list[tuple[int, int, float]] = field(default_factory=list)  # (rows, prefill tokens, ms)
    rows_per_step: float = 0.0

    @property
    def throughput_tok_s(self) -> float:
        return self.output_tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    def summary(self) -> dict:
        return {
            "name": self.name,
            "requests": len(self.ttft_s),
            "output_tokens": self.output_tokens,
            "makespan_s": self.makespan_s,
            "throughput_tok_s": self.throughput_tok_s,
            "ttft_p50_ms": 1e3 * percentile(self.ttft_s, 50),
            "ttft_p95_ms": 1e3 * percentile(self.ttft_s, 95),
            "tpot_p50_ms": 1e3 * percentile(self.tpot_s, 50),
            "tpot_p95_ms": 1e3 * percentile(self.tpot_s, 95),
            "max_gap_p95_ms": 1e3 * percentile(self.max_gap_s, 95),
            "steps": self.steps,
            "rows_per_step": self.rows_per_step,
            "preemptions": self.preemptions,
        }


def percentile(xs: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default); NaN for an empty list."""
    if not xs:
        return math.nan
    s = sorted(xs)
    k = (len(s) - 1) * q / 100.0
    lo = math.floor(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def prompt_ids_for(rid: int, length: int, vocab: tuple[int, int]) -> list[int]:
    """A deterministic prompt of `length` token ids in `[vocab[0], vocab[1])`, distinct per request."""
    lo, hi = vocab
    span = hi - lo
    return [lo + (rid * 7919 + i * 104729) % span for i in range(length)]


def replay(
    policy,
    trace: list[TraceRequest],
    arrivals: list[float],
    executor,
    *,
    vocab: tuple[int, int] = (3, 1000),
    max_steps: int = 10_000_000,
) -> ReplayResult:
    """Run every request of `trace` (arriving at `arrivals`, seconds) to its full output length."""
    if len(trace) != len(arrivals):
        raise ValueError(f"{len(trace)} requests but {len(arrivals)} arrival times")
    order = sorted(range(len(trace)), key=lambda i: arrivals[i])
    timings = [_Timing(arrivals[i], trace[i].output_tokens) for i in range(len(trace))]
    now, nxt, finished, steps = 0.0, 0, 0, 0
    samples: list[tuple[int, int, float]] = []
    rows_total = 0
    while finished < len(trace):
        while nxt < len(order) and arrivals[order[nxt]] <= now:
            i = order[nxt]
            policy.add(i, prompt_ids_for(i, trace[i].prompt_tokens, vocab), trace[i].output_tokens, trace[i].key, now)
            nxt += 1
        if nxt == len(order):
            policy.flush()
        t0 = time.perf_counter()
        batch = policy.schedule(now)
        if not batch.seqs:
            policy.update(None, now)
            wake = [
                t for t in (arrivals[order[nxt]] if nxt < len(order) else None, policy.wake_time()) if t is not None
            ]
            if not wake:
                raise RuntimeError(f"{policy.name}: {len(trace) - finished} requests unfinished and nothing to run")
            now = max(now, min(wake))
            continue
        prefill, rows = policy.last_prefill_tokens, len(batch.seqs)
        out, ms = executor.run(batch, prefill)
        if executor.measures_host:
            ms = (time.perf_counter() - t0) * 1e3  # includes the policy's schedule; update is below
        now += ms / 1e3
        t1 = time.perf_counter()
        events = policy.update(out, now)
        if executor.measures_host:
            # NOTE: the bookkeeping after a step delays the next one; charge it too.
            extra = time.perf_counter() - t1
            now += extra
            ms += extra * 1e3
        samples.append((rows, prefill, ms))
        rows_total += rows
        steps += 1
        if steps > max_steps:
            raise RuntimeError(f"{policy.name}: over {max_steps} steps; the policy is not making progress")
        for rid, emitted, done in events:
            t = timings[rid]
            if emitted:
                if t.tokens == 0:
                    t.first = now
                else:
                    t.max_gap = max(t.max_gap, now - t.last)
                t.last = now
                t.tokens += 1
            if done:
                t.done = now
                finished += 1
    policy.check_integrity()
    for i, t in enumerate(timings):
        if t.tokens != t.want:
            raise RuntimeError(f"{policy.name}: request {i} got {t.tokens} tokens, the trace asks {t.want}")
    start = min(arrivals) if arrivals else 0.0
    return ReplayResult(
        name=policy.name,
        ttft_s=[t.first - t.arrival for t in timings],
        tpot_s=[(t.last - t.first) / (t.tokens - 1) for t in timings if t.tokens > 1],
        max_gap_s=[t.max_gap for t in timings],
        output_tokens=sum(t.tokens for t in timings),
        makespan_s=max((t.done for t in timings), default=start) - start,
        steps=steps,
        preemptions=policy.preemptions,
        step_samples=samples,
        rows_per_step=rows_total / max(steps, 1),
    )
