"""`ringserve bench fleet`: which Envoy balancer serves a fleet better, on the same trace.

For each policy (least-request with two choices; client-side weighted round robin on the ORCA
reports), a fresh `ringserve fleet` of `--replicas` replicas takes the load-test trace at
`--rate` through Envoy while one replica is also flooded directly by a heavy tenant
(`--flood` concurrent long streams, the imbalance a balancer must see). Per policy: the share of
the trace each replica got (from Envoy's per-host counters), TTFT and TPOT percentiles, how many
requests met both targets, and errors. `--flood 0` measures the balanced case.

Loopback only, bounded: each policy runs `--duration` seconds of arrivals plus a drain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from ringserve.tools.fleet.envoy_config import LB_POLICIES
from ringserve.tools.fleet.probe import FleetProcess, free_port_run
from ringserve.tools.harness import loadtest
from ringserve.tools.harness.sse_stream import DONE, iter_sse


async def _flood(url: str, streams: int, max_tokens: int, stop: asyncio.Event) -> int:
    """`streams` closed-loop long completions against one replica until `stop`; how many ended."""
    import aiohttp

    done = 0
    body = {"prompt": "flood", "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    headers = {"Authorization": "Bearer heavy-tenant"}

    async def one(session) -> None:
        nonlocal done
        while not stop.is_set():
            try:
                async with session.post(url + "/v1/completions", json=body, headers=headers) as resp:
                    if resp.status == 200:
                        async for ev in iter_sse(resp):
                            if ev == DONE or stop.is_set():
                                break
                    else:
                        await asyncio.sleep(0.2)
            except aiohttp.ClientError:
                await asyncio.sleep(0.2)
            done += 1

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        tasks = [asyncio.create_task(one(session)) for _ in range(streams)]
        await stop.wait()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return done


async def _policy_run(fleet: FleetProcess, args) -> dict:
    flood_url = fleet.replica_urls()[0]
    stop = asyncio.Event()
    flood = asyncio.create_task(_flood(flood_url, args.flood, args.flood_tokens, stop)) if args.flood else None
    if flood is not None:
        await asyncio.sleep(args.warmup_s)
    lt = loadtest.build_parser().parse_args(
        [
            "--url",
            fleet.url,
            "--rates",
            str(args.rate),
            "--duration",
            str(args.duration),
            "--scale",
            str(args.scale),
            "--keys",
            "2",
            "--drain-s",
            "60",
            "--ttft-target-ms",
            str(args.ttft_target_ms),
            "--tpot-target-ms",
            str(args.tpot_target_ms),
            "--seed",
            str(args.seed),
        ]
    )
    before = fleet.host_stats()
    t0 = time.monotonic()
    rows = await loadtest.run(lt)
    wall = time.monotonic() - t0
    after = fleet.host_stats()
    stop.set()
    if flood is not None:
        await flood
    hosts = sorted(after)
    routed = {h: after[h].get("rq_total", 0.0) - before.get(h, {}).get("rq_total", 0.0) for h in hosts}
    total = sum(routed.values()) or 1.0
    row = rows[0]
    return {
        "split": [round(routed[h] / total, 3) for h in hosts],  # replica 0 (flooded) first
        "routed": [int(routed[h]) for h in hosts],
        "envoy_weights": [after[h].get("weight") for h in hosts],  # ORCA-derived under orca
        "wall_s": round(wall, 1),
        "sent": row["sent"],
        "ok": row["ok"],
        "rejected_429": row["rejected_429"],
        "errors": row["errors"],
        "attainment": round(row["attainment"], 3),
        "ttft_ms": row["ttft_ms"],
        "tpot_ms": row["tpot_ms"],
        "output_tok_s": round(row["output_tok_s"], 1),
    }


def run(args) -> dict:
    results: dict[str, dict] = {}
    for policy in args.policies:
        with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
            base = free_port_run(args.replicas + 2)  # Envoy, admin, then the replicas
            serve = ["--max-rows", str(args.max_rows), "--shm-dir", tmp]
            with FleetProcess(
                Path(tmp) / "run",
                replicas=args.replicas,
                model=args.model,
                ports=(base, base + 2, base + 1),
                lb=policy,
                workers=args.workers,
                serve_args=serve,
            ) as fleet:
                print(f"policy {policy}: fleet up", file=sys.stderr)
                results[policy] = asyncio.run(_policy_run(fleet, args))
    return {
        "replicas": args.replicas,
        "model": args.model,
        "rate": args.rate,
        "duration_s": args.duration,
        "flood_streams": args.flood,
        "results": results,
    }


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve bench fleet", description=__doc__.split("\n\n")[0])
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--model", default="tiny")
    p.add_argument("--workers", type=int, default=1, help="API workers per replica")
    p.add_argument("--max-rows", type=int, default=8, help="row cap per replica (small: contention shows)")
    p.add_argument("--policies", type=lambda s: s.split(","), default=list(LB_POLICIES))
    p.add_argument("--rate", type=float, default=8.0, help="trace arrivals per second through Envoy")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per policy")
    p.add_argument("--scale", type=float, default=0.05, help="trace lengths x this (the tiny model on a CPU)")
    p.add_argument("--flood", type=int, default=8, help="concurrent long streams sent straight to replica 0")
    p.add_argument("--flood-tokens", type=int, default=200)
    p.add_argument("--warmup-s", type=float, default=3.0, help="flood alone this long before the trace")
    p.add_argument("--ttft-target-ms", type=float, default=1000.0)
    p.add_argument("--tpot-target-ms", type=float, default=70.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON (the default prints a table)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for policy in args.policies:
        if policy not in LB_POLICIES:
            print(f"ringserve bench fleet: unknown policy {policy!r}", file=sys.stderr)
            return 2
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print("| policy | split (replica 0 flooded) | TTFT p50 / p95 ms | TPOT p50 / p95 ms | met targets | 429 | errors |")
    print("|---|---|---|---|---|---|---|")
    for policy, r in report["results"].items():
        ttft, tpot = r["ttft_ms"], r["tpot_ms"]
        print(
            f"| {policy} | {' / '.join(f'{s:.0%}' for s in r['split'])} | {ttft['p50']:.0f} / {ttft['p95']:.0f} "
            f"| {tpot['p50']:.1f} / {tpot['p95']:.1f} | {r['attainment']:.0%} | {r['rejected_429']} | {r['errors']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
