"""`ringserve loadtest`: open-loop load against an OpenAI-compatible `/v1/completions` endpoint.

For each arrival rate, requests are sent at Poisson times (never by a fixed pool of users that wait
for their answers, which would hide the queue), each streaming SSE with `ignore_eos` and
`max_tokens` set so output lengths replay the trace exactly; prompts are token-id lists of the
trace's lengths (times `--scale`). Keys rotate over `--keys` Bearer tokens. Per rate it reports
p50 / p95 / p99 of TTFT, TPOT, the longest gap between two tokens and the queue wait (the final
event's `timing.queue_ms`), plus from `/metrics` (sampled while the rate runs, and diffed before /
after): rows per step, KV pool use, preemptions, 429s. Goodput is the highest rate at which 95 % of
requests meet both the TTFT and the TPOT target.

Bounded: every rate sends a fixed number of requests and ends `--drain-s` after its last arrival
(open streams are closed and count as errors); only loopback hosts unless `--allow-remote`.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import random
import sys
import time
from urllib.parse import urlsplit

from ringserve.tools.harness.loadtest_report import RequestRecord, goodput, markdown, plot, summarize_rate
from ringserve.tools.harness.metrics_page import samples
from ringserve.tools.harness.sse_stream import DONE, iter_sse
from ringserve.tools.harness.trace import TraceRequest, builtin_mix, describe, poisson_arrivals, read_jsonl, scaled

METRIC_NAMES = {  # ours first, then the vLLM names, so the tool also reads a vLLM server
    "running_rows": ("ringserve_running_rows", "vllm:num_requests_running"),
    "kv_usage": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "preemptions": ("ringserve_preemptions_total", "vllm:num_preemptions_total"),
    "rejected_429": ('ringserve_requests_rejected_total{status="429"}',),
}


def parse_metrics(text: str) -> dict[str, float]:
    """The figures the load test needs from a Prometheus text page (missing ones are left out). A
    name given without labels takes that family's first series (vLLM labels its by model)."""
    values = samples(text)
    out = {}
    for ours, names in METRIC_NAMES.items():
        for n in names:
            found = values.get(n, next((v for k, v in values.items() if k.startswith(n + "{")), None))
            if found is not None:
                out[ours] = found
                break
    return out


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return
    try:
        if ipaddress.ip_address(host).is_loopback:
            return
    except ValueError:
        pass
    raise SystemExit(
        f"ringserve loadtest: {host!r} is not a loopback address; pass --allow-remote to load "
        "a server on another machine"
    )


def prompt_ids(rng: random.Random, n: int, vocab: tuple[int, int]) -> list[int]:
    return [rng.randrange(*vocab) for _ in range(n)]


async def _one(session, url: str, body: dict, key: str, rec: RequestRecord, timeout_s: float) -> None:
    import aiohttp

    t0 = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, headers=headers, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            rec.status = resp.status
            if resp.status != 200:
                rec.error = (await resp.text())[:200]
                return
            async for ev in iter_sse(resp):
                if ev == DONE:
                    break
                if "error" in ev:
                    rec.error = str(ev["error"])[:200]
                    continue
                choices = ev.get("choices") or []
                if "token_id" in ev or (choices and choices[0].get("text")):
                    rec.token_times.append(time.perf_counter() - t0)
                if choices and choices[0].get("finish_reason"):
                    rec.finish_reason = choices[0]["finish_reason"]
                timing = ev.get("timing")
                if timing and timing.get("queue_ms") is not None:
                    rec.queue_ms = float(timing["queue_ms"])
    except (TimeoutError, aiohttp.ClientError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"[:200]
    except asyncio.CancelledError:
        rec.error = "run ended before the answer did"
        raise


async def _scrape(session, url: str) -> dict[str, float]:
    import aiohttp

    try:
        async with session.get(f"{url}/metrics", timeout=aiohttp.ClientTimeout(total=2)) as resp:
            return parse_metrics(await resp.text()) if resp.status == 200 else {}
    except (TimeoutError, aiohttp.ClientError, ValueError):
        return {}


async def run_rate(session, args, rate: float, trace: list[TraceRequest], rate_seed: int) -> dict:
    """Send `trace` at Poisson `rate`; returns the rate's summary row."""
    rng = random.Random(rate_seed)
    arrivals = poisson_arrivals(len(trace), rate, seed=rate_seed)
    records = [RequestRecord(r.prompt_tokens, r.output_tokens, r.key) for r in trace]
    before = await _scrape(session, args.url)
    samples: list[dict[str, float]] = []
    tasks: list[asyncio.Task] = []
    start = time.perf_counter()

    async def sampler():
        while True:
            samples.append(await _scrape(session, args.url))
            await asyncio.sleep(args.sample_s)

    async def progress():
        while True:
            done = sum(t.done() for t in tasks)
            print(
                f"\rrate {rate:g} req/s: {len(tasks)}/{len(trace)} sent, {done} done, "
                f"{time.perf_counter() - start:5.1f} s",
                end="",
                file=sys.stderr,
                flush=True,
            )
            await asyncio.sleep(0.5)

    side = [asyncio.create_task(sampler()), asyncio.create_task(progress())]
    try:
        for req, at, rec in zip(trace, arrivals, records):
            delay = start + at - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                args.prompt_field: prompt_ids(rng, req.prompt_tokens, args.vocab),
                "max_tokens": req.output_tokens,
                "stream": True,
                "ignore_eos": True,
                "temperature": 0.0,
            }
            if args.model:
                body["model"] = args.model
            tasks.append(asyncio.create_task(_one(session, args.url, body, req.key, rec, args.request_timeout_s)))
        if tasks:
            remaining = max(0.1, start + arrivals[-1] + args.drain_s - time.perf_counter())
            _, pending = await asyncio.wait(tasks, timeout=remaining)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    finally:
        for t in side:
            t.cancel()
        await asyncio.gather(*side, return_exceptions=True)
        print(file=sys.stderr)
    wall = time.perf_counter() - start
    after = await _scrape(session, args.url)
    return summarize_rate(
        rate,
        records,
        ttft_target_ms=args.ttft_target_ms,
        tpot_target_ms=args.tpot_target_ms,
        wall_s=wall,
        before=before,
        after=after,
        samples=[s for s in samples if s],
    )


def _trace_for(args, base: list[TraceRequest], rate: float, index: int) -> list[TraceRequest]:
    n = args.requests if args.requests else max(1, round(args.duration * rate))
    # Each rate takes its own window of the base trace (cycled), so rates see different prompts.
    return [base[(index * n + i) % len(base)] for i in range(n)]


async def run(args) -> list[dict]:
    import aiohttp

    if args.trace:
        base = read_jsonl(args.trace, keys=args.keys)
    else:
        n = (args.requests or max(1, round(args.duration * max(args.rates)))) * len(args.rates)
        base = builtin_mix(n, seed=args.seed, keys=args.keys)
    base = scaled(base, args.scale, args.prompt_scale)
    print(
        f"trace: {describe(base)} (outputs x{args.scale}, prompts x{args.prompt_scale or args.scale}), "
        f"{args.keys} keys",
        file=sys.stderr,
    )
    rows = []
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        for i, rate in enumerate(args.rates):
            rows.append(await run_rate(session, args, rate, _trace_for(args, base, rate, i), args.seed * 1000 + i))
            if args.pause_s and i + 1 < len(args.rates):
                await asyncio.sleep(args.pause_s)
    return rows


def _floats(text: str) -> list[float]:
    vals = [float(x) for x in text.split(",") if x.strip()]
    if not vals or any(v <= 0 for v in vals):
        raise argparse.ArgumentTypeError(f"expected positive numbers separated by commas, got {text!r}")
    return vals


def _vocab(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition(":")
    lo_i, hi_i = int(lo), int(hi)
    if not 0 <= lo_i < hi_i:
        raise argparse.ArgumentTypeError(f"expected LO:HI with 0 <= LO < HI, got {text!r}")
    return lo_i, hi_i


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve loadtest", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    p.add_argument("--rates", type=_floats, default=[0.5, 1, 1.5, 2, 2.5], help="arrival rates, req/s (comma list)")
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply every rate (small hardware: > 1 or < 1)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply prompt and output lengths")
    p.add_argument("--prompt-scale", type=float, help="multiply prompt lengths by this instead of --scale")
    count = p.add_mutually_exclusive_group()
    count.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per rate (default)")
    count.add_argument("--requests", type=int, help="requests per rate instead of --duration")
    p.add_argument("--trace", help="JSONL trace (prompt_tokens, output_tokens[, key]) instead of the built-in mix")
    p.add_argument("--keys", type=int, default=4, help="API keys to rotate (Bearer key-0 ... key-K-1)")
    p.add_argument("--ttft-target-ms", type=float, default=1000.0)
    p.add_argument("--tpot-target-ms", type=float, default=70.0)
    p.add_argument("--model", help="the `model` field to send (vLLM needs it)")
    p.add_argument(
        "--prompt-field",
        default="prompt_token_ids",
        choices=("prompt_token_ids", "prompt"),
        help="send token ids as prompt_token_ids (ringserve) or as a `prompt` list (OpenAI / vLLM)",
    )
    p.add_argument("--vocab", type=_vocab, default=(3, 1000), help="token-id range LO:HI for synthetic prompts")
    p.add_argument("--drain-s", type=float, default=120.0, help="wait this long after a rate's last arrival")
    p.add_argument("--request-timeout-s", type=float, default=300.0)
    p.add_argument("--sample-s", type=float, default=0.2, help="/metrics sampling period")
    p.add_argument("--pause-s", type=float, default=1.0, help="pause between rates")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allow-remote", action="store_true", help="allow a non-loopback host")
    p.add_argument("--json", action="store_true", help="print JSON instead of the markdown table")
    p.add_argument("--plot", metavar="DIR", help="write latency-vs-rate PNGs here")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.url = args.url.rstrip("/")
    if not args.allow_remote:
        check_loopback(args.url)
    if args.requests is not None and args.requests < 1:
        raise SystemExit("ringserve loadtest: --requests must be >= 1")
    if not args.duration > 0:
        raise SystemExit("ringserve loadtest: --duration must be > 0")
    args.rates = [r * args.rate_scale for r in args.rates]
    rows = asyncio.run(run(args))
    report = {
        "url": args.url,
        "scale": args.scale,
        "keys": args.keys,
        "ttft_target_ms": args.ttft_target_ms,
        "tpot_target_ms": args.tpot_target_ms,
        "goodput_rps": goodput(rows),
        "rates": rows,
    }
    if args.plot:
        report["plots"] = plot(
            rows,
            args.plot,
            ttft_target_ms=args.ttft_target_ms,
            tpot_target_ms=args.tpot_target_ms,
            title=f"ringserve loadtest {args.url} (lengths x{args.scale})",
        )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(markdown(rows, ttft_target_ms=args.ttft_target_ms, tpot_target_ms=args.tpot_target_ms))
    ok = sum(r["ok"] for r in rows)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
