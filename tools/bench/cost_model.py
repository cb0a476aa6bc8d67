"""`ringserve bench cost-model [--json]`: the step cost model's estimates against measured steps, per
step kind, on a real server and model (`docs/design.md#cost-model`).

Starts `ringserve serve` (SmolLM2 unless `--model`), so the model is priced by its start-up
calibration alone, then drives three phases, each long enough for `--steps` steps of its kind:

- decode: waves of streams with short prompts and long answers (decode-only steps);
- prefill: long prompts one at a time with `max_tokens` 1 (prefill-only steps: chunks held to the
  step target);
- mixed: streams decoding while long prompts arrive (steps with both).

After each phase it reads the server's `ringserve_cost_ratio{kind}` (the median measured /
estimated time of the last 256 steps of that kind) and `ringserve_cost_steps_total{kind}`, and
prints estimated / measured per kind, which must lie within [0.75, 1.33] (exit status 1
otherwise). `--runs` repeats it on a fresh server each time; `--warm-s S` first runs S seconds of
the phases in turn, unmeasured (the model after an uptime, as the soak sees it);
`--server-args` passes flags through.
Loopback only; the server is stopped at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import aiohttp

from ringserve.tools.harness.metrics_page import scrape
from ringserve.tools.harness.server_process import ringserve_server

BOUNDS = (0.75, 4.0 / 3.0)  # estimated / measured, median per kind (issue 32)
KINDS = ("decode", "prefill", "mixed")


@dataclass(slots=True)
class KindResult:
    kind: str
    steps: int  # steps of the kind in its phase
    est_over_measured: float  # median over the server's window (its last 256 steps of the kind)

    @property
    def ok(self) -> bool:
        return BOUNDS[0] <= self.est_over_measured <= BOUNDS[1]


def text(i: int, words: int) -> str:
    return f"Document {i}. " + " ".join(f"item{(i * 13 + k * 7) % 211} value{(k * 5) % 89}" for k in range(words))


async def _complete(s: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int) -> None:
    """One request, retried after its Retry-After while refused (as the openai SDK does)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.7, "seed": 1}
    for _ in range(60):
        async with s.post(f"{url}/v1/completions", json=body) as resp:
            await resp.read()
            if resp.status == 200:
                return
            if resp.status != 429:
                raise RuntimeError(f"the server answered {resp.status}: {(await resp.text())[:200]}")
            await asyncio.sleep(float(resp.headers.get("Retry-After", 1)))
    raise RuntimeError("refused 60 times in a row")


def _steps(url: str) -> dict[str, float]:
    m = scrape(url)
    return {k: m.get(f'ringserve_cost_steps_total{{kind="{k}"}}', 0.0) for k in KINDS}


def _ratio(url: str, kind: str) -> float:
    r = scrape(url).get(f'ringserve_cost_ratio{{kind="{kind}"}}', 0.0)
    return 1.0 / r if r > 0 else 0.0


async def _phase(url: str, kind: str, steps: int, words: int) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
        start = _steps(url)[kind]
        i = 0
        while _steps(url)[kind] - start < steps:
            i += 1
            if kind == "decode":  # a wave of streams: a few mixed steps to start, then decode only
                await asyncio.gather(*(_complete(s, url, text(i * 100 + j, 8), 96) for j in range((8, 24, 32)[i % 3])))
            elif kind == "prefill":
                await _complete(s, url, text(i, words), 1)
            else:  # streams decoding while long prompts arrive one after another
                streams = [asyncio.create_task(_complete(s, url, text(i * 100 + j, 8), 160)) for j in range(8)]
                for k in range(3):
                    await _complete(s, url, text(i * 10 + k, words), 1)
                await asyncio.gather(*streams)


def run_once(args, work: Path) -> list[KindResult]:
    model = ["--model", args.model] if args.model else []
    child = ringserve_server(work, model + args.server_args.split(), args.ready_timeout_s)
    url = child.ready_url.rsplit("/", 1)[0]
    results = []
    try:
        if args.warm_s > 0:  # an uptime first: the three phases in turn, unmeasured
            end = time.monotonic() + args.warm_s
            while time.monotonic() < end:
                for kind in KINDS:
                    asyncio.run(_phase(url, kind, args.steps // 4 or 1, args.prompt_words))
        for kind in KINDS:
            before = _steps(url)[kind]
            asyncio.run(_phase(url, kind, args.steps, args.prompt_words))
            results.append(KindResult(kind, int(_steps(url)[kind] - before), round(_ratio(url, kind), 3)))
    finally:
        child.stop()
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench cost-model", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model to serve (default: the server's, SmolLM2)")
    p.add_argument("--server-args", default="", help='more server flags, e.g. "--step-target-ms 200"')
    p.add_argument("--steps", type=int, default=120, help="steps of each kind per phase (at least)")
    p.add_argument("--prompt-words", type=int, default=300, help="words of a long prompt (~2.5 tokens each)")
    p.add_argument("--runs", type=int, default=1, help="fresh servers, one after another")
    p.add_argument(
        "--warm-s", type=float, default=0.0, help="seconds of the three phases in turn before measuring (an uptime)"
    )
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    runs: list[list[KindResult]] = []
    with tempfile.TemporaryDirectory(prefix="bench-cost-model-") as work:
        for _ in range(args.runs):
            runs.append(run_once(args, Path(work)))
            if not args.json:
                for r in runs[-1]:
                    verdict = "ok" if r.ok else f"OUTSIDE [{BOUNDS[0]}, {BOUNDS[1]:.2f}]"
                    print(
                        f"run {len(runs)}  {r.kind:<8} {r.steps:>5} steps  estimated/measured {r.est_over_measured:.3f}  {verdict}"
                    )
    ok = all(r.ok for run in runs for r in run)
    if args.json:
        medians = {k: statistics.median(r.est_over_measured for run in runs for r in run if r.kind == k) for k in KINDS}
        print(
            json.dumps(
                {"runs": [[asdict(r) for r in run] for run in runs], "medians": medians, "bounds": BOUNDS, "ok": ok},
                indent=1,
            )
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
