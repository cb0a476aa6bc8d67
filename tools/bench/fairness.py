"""`ringserve bench fairness [--json]`: the design's fairness experiment, on real servers.

Key A floods and key B sends one short streamed request a second (`docs/design.md#fairness`).
Two floods: `in-flight` (A keeps `--in-flight` requests of 200 tokens open, each refilled as it
ends, after its Retry-After when refused, as the openai SDK does) and `burst` (A sends 100 at
once). For each server variant (default: the server's own defaults; `--variant "--prefill-budget
64"` adds one) it reports B's admissions, B's time to first token (median, p95, max, as the client
saw it), B's queue wait as the server measured it (Submit to first join), A's answers and 429s,
A's tokens per second (for the in-flight flood also A alone for as long, on the same server,
just before and just after: what B costs A, against the mean of the two so that a machine whose
speed drifts, or a server slower in its second window, does not decide it), and the longest step a 0.1 s poll of
`ringserve_forward_ms` saw. Variants run one server at a
time in palindrome order (A B B A), each `--runs` times per flood, on the default model (SmolLM2)
unless `--model`. Loopback only; every server is stopped after its run.

Exit status 1 unless every run holds what the design promises: B never refused, B's p95 TTFT
under 1 s, and A keeping 0.85 of its tokens/s alone. `tests/test_fairness_e2e.py` drives the same
clients (`a_request`, `b_request`) through a server.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp

from ringserve.tools.bench.sched_sim import percentile
from ringserve.tools.harness.metrics_page import scrape
from ringserve.tools.harness.server_process import ChildServer, ringserve_server
from ringserve.tools.harness.sse_stream import DONE, iter_sse

B_REQUESTS = 15
_WINDOWS = itertools.count()  # each in-flight window's prompts start at its own index
B_TTFT_P95_MS = 1000.0  # the design's promise to the light tenant
A_SHARE = 0.85  # of A's tokens/s alone that A keeps while B is served (issue 32)


def prompt(i: int, words: int) -> str:
    return f"Request {i}: " + " ".join(f"word{(i * 31 + k * 7) % 97}" for k in range(words))


@dataclass(slots=True)
class BAnswer:
    status: int
    ttft_s: float | None = None  # the client's: send to the first event with text
    queue_ms: float | None = None  # the server's: Submit to first join (the final event's timing)
    tokens: int = 0  # tokens it was answered with


async def a_request(s: aiohttp.ClientSession, url: str, i: int, statuses: list[int], max_tokens: int = 200) -> float:
    """One of key A's requests; its Retry-After (0 when it was answered)."""
    body = {"prompt": prompt(i, 60), "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0.8, "seed": i}
    async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer key-a"}) as resp:
        await resp.read()
        statuses.append(resp.status)
        return float(resp.headers.get("Retry-After", 0))


async def b_request(s: aiohttp.ClientSession, url: str, i: int) -> BAnswer:
    """One short streamed request of key B."""
    t0 = time.perf_counter()
    body = {"prompt": prompt(1000 + i, 8), "max_tokens": 8, "temperature": 0.0, "stream": True}
    async with s.post(f"{url}/v1/completions", json=body, headers={"Authorization": "Bearer key-b"}) as resp:
        if resp.status != 200:
            await resp.read()
            return BAnswer(resp.status)
        answer = BAnswer(200)
        async for ev in iter_sse(resp):
            if ev == DONE:
                continue
            choices = ev.get("choices") or []
            if answer.ttft_s is None and choices and choices[0].get("text"):
                answer.ttft_s = time.perf_counter() - t0
            if ev.get("timing"):
                answer.queue_ms = ev["timing"].get("queue_ms")
            if ev.get("usage"):
                answer.tokens = ev["usage"].get("completion_tokens", 0)
        return answer


async def b_one_a_second(s: aiohttp.ClientSession, url: str, n: int = B_REQUESTS) -> list[BAnswer]:
    tasks = []
    for i in range(n):
        tasks.append(asyncio.create_task(b_request(s, url, i)))
        await asyncio.sleep(1.0)
    return list(await asyncio.gather(*tasks))


async def warm_up(url: str) -> None:
    """The first steps of each new batch shape are several times slower on the CPU (oneDNN builds
    a primitive per shape): start-up cost, not what is measured."""
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        for rows in (1, 8, 32):
            statuses: list[int] = []
            await asyncio.gather(*(a_request(s, url, i, statuses, max_tokens=24) for i in range(rows)))


async def in_flight(
    url: str, a_rows: int, b_count: int = B_REQUESTS, with_b: bool = True, first: int = 0
) -> tuple[list[BAnswer], list[int]]:
    """A keeps `a_rows` requests open (refilled as they end, after the Retry-After when refused);
    B sends one a second once the flood holds every row (`with_b` False: A alone, as long)."""
    a_statuses: list[int] = []
    stop = asyncio.Event()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:

        async def a_loop(i: int) -> None:
            k = 0
            while not stop.is_set():
                # NOTE: a client that retried a 429 at once would make a retry storm of cheap
                # refusals: a request rate limit's job, not admission's.
                await asyncio.sleep(await a_request(s, url, first + 100 * k + i, a_statuses))
                k += 1

        flood = [asyncio.create_task(a_loop(i)) for i in range(a_rows)]
        await asyncio.sleep(3.0)
        if with_b:
            b = await b_one_a_second(s, url, b_count)
        else:
            b = []
            await asyncio.sleep(float(b_count))
        stop.set()
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return b, a_statuses


async def burst(url: str, a_count: int = 100, b_count: int = B_REQUESTS) -> tuple[list[BAnswer], list[int]]:
    """A sends `a_count` long requests at once; B sends one a second a second later."""
    a_statuses: list[int] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        flood = [asyncio.create_task(a_request(s, url, i, a_statuses)) for i in range(a_count)]
        await asyncio.sleep(1.0)
        b = await b_one_a_second(s, url, b_count)
        for t in flood:
            t.cancel()
        await asyncio.gather(*flood, return_exceptions=True)
    return b, a_statuses


@dataclass
class Run:
    variant: str
    flood: str
    b_admitted: int
    b_sent: int
    b_ttft_ms: list[float]
    b_queue_ms: list[float]
    a_answered: int  # of A's requests that ended in the window (a 200-token answer often outlasts it)
    a_refused: int
    longest_step_ms: float
    a_tokens_per_s: float = 0.0  # tokens the server generated for A in the flood's window
    a_alone_tokens_per_s: float | None = None  # the same flood without B, on the same server (in-flight)
    summary: dict = field(default_factory=dict)

    def summarize(self) -> None:
        t, q = self.b_ttft_ms, self.b_queue_ms
        self.summary = {
            "b_ttft_p50_ms": percentile(t, 50) if t else None,
            "b_ttft_p95_ms": percentile(t, 95) if t else None,
            "b_ttft_max_ms": max(t) if t else None,
            "b_queue_max_ms": max(q) if q else None,
            "a_share_of_alone": (
                round(self.a_tokens_per_s / self.a_alone_tokens_per_s, 3) if self.a_alone_tokens_per_s else None
            ),
        }


def wait_idle(url: str, timeout_s: float = 60.0) -> None:
    """Until the last flood's cancelled requests have left: each flood starts on an idle batch
    with nothing of A's still charged to its queue."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        m = scrape(url, timeout=5)
        if m.get("ringserve_running_rows") == 0 and m.get("ringserve_queue_depth") == 0:
            return
        time.sleep(0.1)
    raise RuntimeError(f"the server did not go idle within {timeout_s:.0f} s")


def _longest_step(url: str, stop: list[bool], seen: list[float]) -> None:
    while not stop:
        try:
            seen.append(scrape(url, timeout=5).get("ringserve_forward_ms", 0.0))
        except OSError:
            pass
        time.sleep(0.1)


def _generated(url: str) -> float:
    return scrape(url, timeout=5).get("ringserve_gpu_generation_tokens_total", 0.0)


async def _measure(url: str, flood: str, args, with_b: bool = True) -> tuple[list[BAnswer], list[int], float, float]:
    """B's answers, A's statuses, the longest step seen, and A's generated tokens per second."""
    stop: list[bool] = []
    seen: list[float] = [0.0]
    poller = asyncio.get_running_loop().run_in_executor(None, _longest_step, url, stop, seen)
    tokens0, t0 = _generated(url), time.perf_counter()
    try:
        b, a = await (
            # NOTE: prompts of their own per window: a window sending the prompts of the one before
            # would find them in the prefix cache and look faster
            in_flight(url, args.in_flight, args.b_requests, with_b, first=next(_WINDOWS) * 1_000_000)
            if flood == "in-flight"
            else burst(url, args.burst, args.b_requests)
        )
    finally:
        stop.append(True)
        await poller
    a_tokens = _generated(url) - tokens0 - sum(x.tokens for x in b)
    # NOTE: the first poll reads the step before the flood
    return b, a, max(seen[2:], default=0.0), a_tokens / (time.perf_counter() - t0)


def _serve(args, variant: str, work: Path) -> ChildServer:
    model = ["--model", args.model] if args.model else []
    return ringserve_server(work, model + variant.split(), args.ready_timeout_s, name=f"ringserve {variant}")


def _alone(url: str, args) -> float:
    wait_idle(url)
    return asyncio.run(_measure(url, "in-flight", args, with_b=False))[3]


def run_variant(args, variant: str, work: Path) -> list[Run]:
    """One server of `variant`, each flood once; for the in-flight flood, also A alone for as long
    just before and just after (A's rate alone is their mean)."""
    child = _serve(args, variant, work)
    url = child.ready_url.rsplit("/", 1)[0]
    runs = []
    try:
        asyncio.run(warm_up(url))
        for flood in args.flood:
            alone = _alone(url, args) if flood == "in-flight" else None
            wait_idle(url)
            b, a, longest, a_rate = asyncio.run(_measure(url, flood, args))
            if alone is not None:
                alone = (alone + _alone(url, args)) / 2
            run = Run(
                variant or "defaults",
                flood,
                sum(x.status == 200 for x in b),
                len(b),
                [round(x.ttft_s * 1000, 1) for x in b if x.ttft_s is not None],
                [round(x.queue_ms, 1) for x in b if x.queue_ms is not None],
                sum(s == 200 for s in a),
                sum(s == 429 for s in a),
                round(longest, 1),
                round(a_rate, 1),
                round(alone, 1) if alone is not None else None,
            )
            run.summarize()
            runs.append(run)
    finally:
        child.stop()
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench fairness", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="", help="model to serve (default: the server's, SmolLM2)")
    p.add_argument(
        "--variant", action="append", default=[], help='server flags of another variant, e.g. "--prefill-budget 64"'
    )
    p.add_argument("--flood", action="append", choices=["in-flight", "burst"], help="default: both")
    p.add_argument("--in-flight", type=int, default=48, help="A's open requests in the in-flight flood")
    p.add_argument("--burst", type=int, default=100, help="A's requests in the burst flood")
    p.add_argument("--b-requests", type=int, default=B_REQUESTS, help="B's requests, one a second")
    p.add_argument("--runs", type=int, default=1, help="runs of each variant (palindrome order)")
    p.add_argument("--ready-timeout-s", type=float, default=600.0)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    args.flood = args.flood or ["in-flight", "burst"]
    variants = ["", *args.variant]
    order = [v for _ in range(args.runs) for v in (variants if _ % 2 == 0 else variants[::-1])]
    runs: list[Run] = []
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as work:
        for variant in order:
            for run in run_variant(args, variant, Path(work)):
                runs.append(run)
                if not args.json:
                    s = run.summary
                    print(
                        f"{run.variant:<24} {run.flood:<9} B {run.b_admitted}/{run.b_sent} admitted, TTFT p50 "
                        f"{s['b_ttft_p50_ms']:.0f} p95 {s['b_ttft_p95_ms']:.0f} max {s['b_ttft_max_ms']:.0f} ms, "
                        f"queue max {s['b_queue_max_ms'] or 0:.0f} ms; A {run.a_answered} answered, {run.a_refused} "
                        f"429, {run.a_tokens_per_s:.0f} tok/s"
                        + (f" ({s['a_share_of_alone']:.2f} of alone)" if s["a_share_of_alone"] else "")
                        + f"; longest step {run.longest_step_ms:.0f} ms",
                        flush=True,
                    )
    if args.json:
        medians: dict[str, dict] = {}
        for r in runs:
            medians.setdefault(f"{r.variant} | {r.flood}", {})
        for name in medians:
            mine = [r.summary for r in runs if f"{r.variant} | {r.flood}" == name]
            medians[name] = {
                k: statistics.median(v) for k in mine[0] if (v := [x[k] for x in mine if x[k] is not None])
            }
        print(json.dumps({"runs": [asdict(r) for r in runs], "medians_of_runs": medians}, indent=1))
    return 0 if all(run_holds(r) for r in runs) else 1


def run_holds(run: Run) -> bool:
    """What the design promises (issue 32): B never refused, B's p95 TTFT under B_TTFT_P95_MS, and
    A keeping at least A_SHARE of what it gets alone."""
    s = run.summary
    share = s["a_share_of_alone"]
    return (
        run.b_admitted == run.b_sent
        and s["b_ttft_p95_ms"] is not None
        and s["b_ttft_p95_ms"] < B_TTFT_P95_MS
        and (share is None or share >= A_SHARE)
    )
