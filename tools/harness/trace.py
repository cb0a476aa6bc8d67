"""Request traces for the load test and the scheduler comparison: lengths, keys and arrival times.

A trace is a list of `TraceRequest(prompt_tokens, output_tokens, key)`. It comes from a JSONL file
(one object per line with `prompt_tokens` and `output_tokens`, or vLLM-style `input_len` /
`output_len`, and an optional `key`) or from the built-in mix:

- prompt tokens: log-normal, median 760, sigma 1.0 (mean 1,250 before clipping), clipped to
  50..8,000 — most prompts are a few hundred tokens, a long tail reaches the limit;
- output tokens: log-normal, median 182, sigma 1.0 (mean 300 before clipping), clipped to 1..1,000;
- prompt + output never exceeds the 8,192-token context (the output is shortened first).

The medians and sigmas put the means at the design's averages (docs/design.md#sizing) (1,250 prompt, 300 output tokens); the
clipping pulls the measured means a little lower (1,221 and 271 on 10,000 draws, seed 0). Lengths
scale by a factor for small hardware (`scaled`), never below 1 token. Arrivals are Poisson
(exponential gaps) at a fixed rate: the load is open-loop, so a slow server sees its queue grow
instead of its users slowing down.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

PROMPT_RANGE = (50, 8000)
OUTPUT_RANGE = (1, 1000)
CONTEXT_LIMIT = 8192
PROMPT_MEAN, OUTPUT_MEAN, SIGMA = 1250.0, 300.0, 1.0


@dataclass(frozen=True, slots=True)
class TraceRequest:
    """One request's shape: what the load generator sends and how long the answer must be."""

    prompt_tokens: int
    output_tokens: int
    key: str = "key-0"

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"prompt_tokens must be >= 1, got {self.prompt_tokens}")
        if self.output_tokens < 1:
            raise ValueError(f"output_tokens must be >= 1, got {self.output_tokens}")


def _lognormal(rng: random.Random, mean: float, lo: int, hi: int) -> int:
    mu = math.log(mean) - SIGMA * SIGMA / 2  # mean of a log-normal is exp(mu + sigma^2 / 2)
    return int(min(hi, max(lo, round(rng.lognormvariate(mu, SIGMA)))))


def builtin_mix(n: int, *, seed: int = 0, keys: int = 1, context_limit: int = CONTEXT_LIMIT) -> list[TraceRequest]:
    """`n` requests from the built-in length mix (see the module doc), keys assigned round-robin."""
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if keys < 1:
        raise ValueError(f"keys must be >= 1, got {keys}")
    rng = random.Random(seed)
    out = []
    for i in range(n):
        p = _lognormal(rng, PROMPT_MEAN, *PROMPT_RANGE)
        o = _lognormal(rng, OUTPUT_MEAN, *OUTPUT_RANGE)
        out.append(TraceRequest(p, max(1, min(o, context_limit - p)), f"key-{i % keys}"))
    return out


def read_jsonl(path: str | Path, *, keys: int = 1) -> list[TraceRequest]:
    """Read a JSONL trace. Lines without a `key` get `key-<i mod keys>`; blank lines are skipped."""
    out: list[TraceRequest] = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                p = obj["prompt_tokens"] if "prompt_tokens" in obj else obj["input_len"]
                o = obj["output_tokens"] if "output_tokens" in obj else obj["output_len"]
                key = str(obj.get("key", f"key-{len(out) % keys}"))
                out.append(TraceRequest(int(p), int(o), key))
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{path}:{lineno}: expected an object with prompt_tokens and output_tokens "
                    f"(or input_len and output_len), both >= 1: {exc}"
                ) from None
    return out


def scaled(trace: list[TraceRequest], factor: float, prompt_factor: float | None = None) -> list[TraceRequest]:
    """Every length times `factor` (rounded, at least 1): the same skew on smaller hardware.

    `prompt_factor`, when given, scales prompts apart from outputs: on hardware where a prompt
    token costs a larger share of a decode step than on the design's GPU, a smaller prompt factor
    keeps prefill's share of the work near the design's."""
    pf = factor if prompt_factor is None else prompt_factor
    if not (factor > 0 and pf > 0):
        raise ValueError(f"scale factors must be > 0, got {factor} and {pf}")
    return [
        TraceRequest(max(1, round(r.prompt_tokens * pf)), max(1, round(r.output_tokens * factor)), r.key) for r in trace
    ]


def poisson_arrivals(n: int, rate: float, *, seed: int = 0) -> list[float]:
    """`n` arrival offsets in seconds (the first at 0) with exponential gaps of mean 1/rate.

    `rate` = inf gives a burst: every request at 0."""
    if not rate > 0:
        raise ValueError(f"rate must be > 0 requests/s, got {rate}")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    t, out = 0.0, []
    for i in range(n):
        if i:
            t += rng.expovariate(rate)
        out.append(t)
    return out


def describe(trace: list[TraceRequest]) -> str:
    """One line: count and prompt/output means and ranges, for reports."""
    if not trace:
        return "0 requests"
    ps = [r.prompt_tokens for r in trace]
    os_ = [r.output_tokens for r in trace]
    return (
        f"{len(trace)} requests, prompt mean {sum(ps) / len(ps):.0f} ({min(ps)}..{max(ps)}), "
        f"output mean {sum(os_) / len(os_):.0f} ({min(os_)}..{max(os_)})"
    )
