"""`ringserve bench tracing [--json]`: what tracing costs when its collector is up, down or slow
(issue 37; docs/design.md#observability).

Four variants, each on a fresh `ringserve serve` (SmolLM2 unless `--model`), every request sampled:

    off    no --otlp-traces-endpoint (the baseline)
    up     an OTLP/HTTP receiver that answers at once
    dead   an endpoint nothing listens on
    slow   a receiver that answers each export after `--slow-s` (past the exporter's 2 s timeout)

In each of `--rounds` rounds every variant runs once, the order reversed every other round. A run:
`--warmup` requests, then a closed loop of `--concurrency` streams sends `--requests` streamed
completions (a window of real text, `--output-tokens` each, EOS ignored) while the worker's RSS is
sampled every 0.2 s. Reported per run: tok/s, TTFT p50 / p95, the worker's RSS at the start and its
peak, the spans the receiver got and the server's span counters (`ringserve_trace_spans_total`:
exported, failed, dropped; `ringserve_trace_spans_waiting`), read `--drain-s` after the load. Per variant: medians, and tok/s and TTFT p95 as ratios to off's
(what tracing itself costs) and to up's (what a collector's trouble adds).

The checks (exit 1 when one fails): a collector down or slow changes nothing, so dead and slow keep
tok/s at least `--min-ratio` of up's median and TTFT p95 at most up's median times
`1 / --min-ratio` plus one step target; every dead and slow run that made more spans than the
queue holds plus what the slowest exporter moves (a batch per export timeout) dropped some at the
bound (SmolLM2 on 2 cores makes too few to reach it; the tiny model makes enough), never had more
than `QUEUE_SPANS` waiting, and its
worker's RSS peak stayed within `--rss-mib` of its start; with the collector up, no span was lost.
Loopback only; every run is bounded by its request count and the request timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from ringserve.api.request_trace import EXPORT_BATCH, EXPORT_TIMEOUT_S, QUEUE_SPANS
from ringserve.shm.segment import instance_id
from ringserve.tools.bench.peer_workloads import DATA
from ringserve.tools.bench.peers import closed_loop, summarize
from ringserve.tools.harness.drill import attach_control
from ringserve.tools.harness.metrics_page import scrape
from ringserve.tools.harness.otlp_receiver import OtlpReceiver
from ringserve.tools.harness.ports import free_port
from ringserve.tools.harness.server_process import ringserve_server
from ringserve.tools.harness.soak import rss_bytes

VARIANTS = ("off", "up", "dead", "slow")
MIB = 1 << 20


def prompts(n: int, words: int) -> list[str]:
    """`n` windows of `words` words of the English text in tools/data, each at its own offset."""
    text = (DATA / "english.txt").read_text().split()
    step = max(1, (len(text) - words) // max(1, n))
    return [" ".join(text[(i * step) % (len(text) - words) :][:words]) for i in range(n)]


class RssWatch:
    """Samples one pid's RSS every `period_s` on a thread: the first sample and the peak."""

    def __init__(self, pid: int, period_s: float = 0.2) -> None:
        self.pid, self.period_s = pid, period_s
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            if (r := rss_bytes(self.pid)) is not None:
                self.samples.append(r)
            self._stop.wait(self.period_s)

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def _worker_pid(child) -> int:
    seg, control = attach_control(str(child.log_path.parent), instance_id(child.running.pid))
    try:
        return int(control.worker_slot(0)["pid"])
    finally:
        seg.close()


def run_once(args, work: Path, variant: str) -> dict:
    receiver = OtlpReceiver(delay_s=args.slow_s if variant == "slow" else 0.0) if variant in ("up", "slow") else None
    server_args = ["--model", args.model] if args.model else []
    if variant != "off":
        endpoint = receiver.url if receiver else f"http://127.0.0.1:{free_port()}"  # dead: nothing listens
        server_args += ["--otlp-traces-endpoint", endpoint, "--otlp-traces-sample-rate", "1.0"]
    server_args += args.server_args.split()
    texts = prompts(args.requests + args.warmup, args.prompt_words)

    def body(text: str) -> dict:
        return {"prompt": text, "max_tokens": args.output_tokens, "ignore_eos": True, "stream": True}

    if receiver:
        receiver.__enter__()
    child = ringserve_server(work, server_args, args.ready_timeout_s)
    try:
        url = child.ready_url.rsplit("/", 1)[0]
        asyncio.run(closed_loop(url, [body(t) for t in texts[: args.warmup]], args.concurrency, args.timeout_s))
        with RssWatch(_worker_pid(child)) as rss:
            answers, wall = asyncio.run(
                closed_loop(url, [body(t) for t in texts[args.warmup :]], args.concurrency, args.timeout_s)
            )
        out = summarize(answers, wall, args.output_tokens)
        time.sleep(args.drain_s)  # what the exporter can still send, it sends
        m = scrape(url)
        out["step_target_ms"] = m.get("ringserve_step_target_ms", 0.0)
        for outcome in ("exported", "failed", "dropped"):
            out[f"spans_{outcome}"] = int(m.get(f'ringserve_trace_spans_total{{outcome="{outcome}"}}', 0))
        out["spans_waiting"] = int(m.get("ringserve_trace_spans_waiting", 0))
    finally:
        child.stop()
        if receiver:
            receiver.__exit__()
    out.update(
        variant=variant,
        rss_start_mib=round(rss.samples[0] / MIB, 1) if rss.samples else None,
        rss_peak_mib=round(max(rss.samples) / MIB, 1) if rss.samples else None,
        spans_received=len(receiver.spans) if receiver else None,
    )
    return out


def order(rounds: int) -> list[str]:
    """Every variant once a round, reversed every other round (off first, then off last)."""
    return [v for r in range(rounds) for v in (VARIANTS if r % 2 == 0 else VARIANTS[::-1])]


def combine(runs: list[dict]) -> dict:
    out = {}
    for v in VARIANTS:
        mine = [r for r in runs if r["variant"] == v]
        if mine:
            out[v] = {
                k: statistics.median(r[k] for r in mine)
                for k in ("tok_s", "ttft_ms_p50", "ttft_ms_p95", "rss_start_mib", "rss_peak_mib")
                if all(r[k] is not None for r in mine)
            }
    for v, m in out.items():
        for name, base in (("off", out.get("off")), ("up", out.get("up"))):
            if base and v != name:
                m[f"tok_s_vs_{name}"] = round(m["tok_s"] / base["tok_s"], 3)
                m[f"ttft_p95_vs_{name}"] = round(m["ttft_ms_p95"] / base["ttft_ms_p95"], 3)
    return out


def checks(runs: list[dict], medians: dict, args) -> list[tuple[str, bool]]:
    out = []
    failed = [r for r in runs if r["ok"] != r["requests"] or r["wrong_length"]]
    out.append(("every request answered in full", not failed))
    base = medians.get("up")
    up_lost = sum(r["spans_dropped"] + r["spans_failed"] for r in runs if r["variant"] == "up")
    out.append(("up: every span exported, none dropped or failed", up_lost == 0))
    for v in ("dead", "slow"):
        m = medians.get(v)
        if not (m and base):
            continue
        out.append((f"{v}: tok/s >= {args.min_ratio} of up's", m["tok_s"] >= args.min_ratio * base["tok_s"]))
        step = max(r["step_target_ms"] for r in runs)
        limit = base["ttft_ms_p95"] / args.min_ratio + step
        out.append((f"{v}: TTFT p95 <= {limit:.0f} ms (up's / {args.min_ratio} + a step)", m["ttft_ms_p95"] <= limit))
        mine = [r for r in runs if r["variant"] == v]
        grown = max(r["rss_peak_mib"] - r["rss_start_mib"] for r in mine)
        waiting = max(r["spans_waiting"] for r in mine)
        for r in mine:
            out.append(bound_check(v, r))
        out.append((f"{v}: at most {QUEUE_SPANS} spans waiting (most {waiting})", waiting <= QUEUE_SPANS))
        out.append((f"{v}: worker RSS grew {grown:.1f} MiB at most, <= {args.rss_mib}", grown <= args.rss_mib))
    return out


def bound_check(variant: str, r: dict) -> tuple[str, bool]:
    """A run that made more spans than the queue holds plus what the slowest exporter moves (a
    batch per export timeout) must have dropped some; a run that made fewer never reached the bound."""
    made = r["spans_exported"] + r["spans_failed"] + r["spans_dropped"] + r["spans_waiting"]
    drained = EXPORT_BATCH * r["wall_s"] / EXPORT_TIMEOUT_S
    if made > QUEUE_SPANS + drained:
        return (f"{variant}: {made} spans made, {r['spans_dropped']} dropped at the bound", r["spans_dropped"] > 0)
    return (f"{variant}: {made} spans made in {r['wall_s']:.0f} s, the bound not reached (no drop needed)", True)


def run(args) -> dict:
    runs = []
    with tempfile.TemporaryDirectory(prefix="bench-tracing-") as tmp:
        for variant in order(args.rounds):
            runs.append(run_once(args, Path(tmp), variant))
            if not args.json:
                r = runs[-1]
                print(
                    f"{variant:>5}: {r['tok_s']:8.1f} tok/s  TTFT p50 {r['ttft_ms_p50']:7.1f} p95 "
                    f"{r['ttft_ms_p95']:7.1f} ms  worker RSS {r['rss_start_mib']} -> {r['rss_peak_mib']} MiB"
                    f"  spans received {r['spans_received']} exported {r['spans_exported']} failed"
                    f" {r['spans_failed']} dropped {r['spans_dropped']}",
                    flush=True,
                )
    medians = combine(runs)
    report = {"runs": runs, "medians": medians, "settings": vars(args), "queue_spans": QUEUE_SPANS}
    report["checks"] = [{"check": c, "ok": ok} for c, ok in checks(runs, medians, args)]
    return report


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve bench tracing", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default="", help="model to serve (default: the server's, SmolLM2)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=1200, help="measured requests per run")
    p.add_argument("--warmup", type=int, default=32)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--slow-s", type=float, default=5.0, help="the slow receiver's delay per export")
    p.add_argument("--drain-s", type=float, default=1.0, help="wait before reading the span counters")
    p.add_argument("--min-ratio", type=float, default=0.9, help="dead and slow keep this share of up's tok/s")
    p.add_argument("--rss-mib", type=float, default=48.0, help="a dead or slow run's worker RSS growth limit")
    p.add_argument("--server-args", default="", help="more `ringserve serve` arguments, one string")
    p.add_argument("--ready-timeout-s", type=float, default=300.0)
    p.add_argument("--timeout-s", type=float, default=120.0, help="one request's limit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for v, m in report["medians"].items():
            print(f"median {v:>5}: " + ", ".join(f"{k} {x}" for k, x in m.items()))
        for c in report["checks"]:
            print(f"{'ok  ' if c['ok'] else 'FAIL'} {c['check']}")
    return 0 if all(c["ok"] for c in report["checks"]) else 1


if __name__ == "__main__":
    sys.exit(main())
