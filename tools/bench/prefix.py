"""`ringserve bench prefix [--json]`: what prefix caching buys, measured in-process.

The real engine (tiny model unless `--model`) under the real Scheduler, no rings or HTTP:

- TTFT: a request whose first `--prefix` (1,500) tokens are cached (an earlier request with the same
  prefix has finished) against one whose prefix is cold; both have a `--suffix`-token tail and
  sample one token. Medians over `--reps` fresh prefixes, after one warm-up request.
- Throughput: a trace of `--requests` requests, `--share` of which start with one `--system`-token
  system prompt (the rest have unique prompts of the same length), each with a 32-128-token user
  tail and `--max-tokens` generated tokens (seeded sampling, EOS ignored); one request arrives per
  engine step. Run with caching on and off, alternating `--trace-reps` times (the median run of
  each is reported); tokens/s is generated tokens per wall second, and the streams of every run
  are compared (they must be identical).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from typing import Any


def _request(key: int, prompt: list[int], max_tokens: int, seed: int):
    from ringserve.gpu_proc.request import Request
    from ringserve.shm.messages import SamplingParams

    return Request(
        key=(0, key),
        request_id=f"bench-{key}",
        tenant=f"t{key % 4}",
        prompt_ids=prompt,
        max_tokens=max_tokens,
        arrival_ts=0.0,
        deadline_ts=1e18,
        sampling=SamplingParams(temperature=0.8, top_p=0.95, seed=seed, ignore_eos=True),
    )


class _Bench:
    """One engine, and a fresh scheduler (and block pool) per measured run."""

    def __init__(self, model_dir: str, num_blocks: int, max_rows: int, prefill_budget: int, threads: int = 1) -> None:
        from ringserve.config import Config
        from ringserve.gpu_proc.executor import build_executor

        self.kwargs: dict[str, Any] = dict(
            num_blocks=num_blocks,
            max_rows=max_rows,
            prefill_budget=prefill_budget,
            context_limit=8192,
            max_tokens_limit=1024,
            queue_limit_s=1e9,
            device="cpu",
            cpu_threads=threads,
        )
        self.engine = build_executor(Config(**self.kwargs), model_dir)
        self.config_cls = Config

    def scheduler(self, caching: bool):
        from ringserve.gpu_proc.block_manager import BlockManager
        from ringserve.gpu_proc.scheduler import Scheduler

        config = self.config_cls(prefix_caching=caching, **self.kwargs)
        return Scheduler(
            config, BlockManager(config.num_blocks, config.block_size), eos_token_ids=self.engine.eos_token_ids
        )

    def drive(self, sched, arrivals: list) -> dict:
        """Admit `arrivals[k]` before step k (then the rest as steps go on) and run to idle.
        Per request key: wall seconds from admission to its first token; plus streams and wall time."""
        from ringserve.shm.messages import Token

        admitted: dict = {}
        ttft: dict = {}
        streams: dict = {}
        pending = list(arrivals)
        t0 = time.perf_counter()
        while pending or sched.has_work:
            if pending:
                req = pending.pop(0)
                if not sched.admit(req).accepted:
                    raise RuntimeError(f"bench request {req.key} was refused; raise --blocks")
                admitted[req.key] = time.perf_counter()
            batch = sched.schedule()
            samples = self.engine.step(batch) if batch.seqs else None
            now = time.perf_counter()
            for slot, ev in sched.update(samples):
                if isinstance(ev, Token):
                    key = (slot, ev.rid)
                    ttft.setdefault(key, now - admitted[key])
                    streams.setdefault((key, ev.index), []).append(ev.token_id)
        return {"wall_s": time.perf_counter() - t0, "ttft": ttft, "streams": streams, "stats": sched.stats()}


def _tokens(rng: random.Random, vocab: int, n: int) -> list[int]:
    return [rng.randrange(3, vocab) for _ in range(n)]


def measure_ttft(bench: _Bench, prefix: int, suffix: int, reps: int, seed: int) -> dict:
    rng = random.Random(seed)
    vocab = bench.engine.vocab_size
    sched = bench.scheduler(True)
    bench.drive(sched, [_request(0, _tokens(rng, vocab, prefix + suffix), 1, 0)])  # warm-up
    cached, cold, hit_tokens = [], [], []
    for k in range(reps):
        shared = _tokens(rng, vocab, prefix)
        base = 10 * (k + 1)
        bench.drive(sched, [_request(base, shared + _tokens(rng, vocab, suffix), 1, base)])  # fills the cache
        hits0 = sched.stats().prefix_cache_hits
        cached.append(
            bench.drive(sched, [_request(base + 1, shared + _tokens(rng, vocab, suffix), 1, base)])["ttft"][
                (0, base + 1)
            ]
        )
        hit_tokens.append(sched.stats().prefix_cache_hits - hits0)
        cold.append(
            bench.drive(sched, [_request(base + 2, _tokens(rng, vocab, prefix + suffix), 1, base)])["ttft"][
                (0, base + 2)
            ]
        )
    c_ms, x_ms = statistics.median(cached) * 1e3, statistics.median(cold) * 1e3
    return {
        "prompt_tokens": prefix + suffix,
        "cached_tokens": int(statistics.median(hit_tokens)),
        "ttft_cached_ms": round(c_ms, 2),
        "ttft_cold_ms": round(x_ms, 2),
        "ttft_speedup": round(x_ms / c_ms, 2),
        "reps": reps,
    }


def measure_trace(
    bench: _Bench, requests: int, share: float, system: int, max_tokens: int, seed: int, reps: int = 1
) -> dict:
    rng = random.Random(seed)
    vocab = bench.engine.vocab_size
    sys_prompt = _tokens(rng, vocab, system)
    prompts = []
    for _ in range(requests):
        tail = _tokens(rng, vocab, rng.randint(32, 128))
        prompts.append((sys_prompt if rng.random() < share else _tokens(rng, vocab, system)) + tail)
    shared_count = sum(p[:system] == sys_prompt for p in prompts)
    out: dict[str, Any] = {
        "requests": requests,
        "shared_requests": shared_count,
        "system_tokens": system,
        "max_tokens": max_tokens,
        "reps": reps,
    }
    runs: dict = {True: [], False: []}
    for _ in range(reps):  # alternate on and off, so a change in machine load hits both alike
        for caching in (True, False):
            arrivals = [_request(k, p, max_tokens, 1000 + k) for k, p in enumerate(prompts)]
            runs[caching].append(bench.drive(bench.scheduler(caching), arrivals))
    for caching in (True, False):
        r = sorted(runs[caching], key=lambda x: x["wall_s"])[len(runs[caching]) // 2]  # the median run
        st = r["stats"]
        gen = st.generation_tokens_total
        out["on" if caching else "off"] = {
            "wall_s": round(r["wall_s"], 3),
            "wall_s_all": [round(x["wall_s"], 3) for x in runs[caching]],
            "gen_tokens_per_s": round(gen / r["wall_s"], 1),
            "requests_per_s": round(requests / r["wall_s"], 2),
            "ttft_mean_ms": round(1e3 * statistics.fmean(r["ttft"].values()), 1),
            "ttft_p50_ms": round(1e3 * statistics.median(r["ttft"].values()), 1),
            "prompt_tokens": st.prompt_tokens_total,
            "prompt_tokens_cached": st.prefix_cache_hits,
            "hit_rate": round(st.prefix_cache_hits / st.prefix_cache_queries, 3) if st.prefix_cache_queries else 0.0,
        }
    out["throughput_speedup"] = round(out["on"]["gen_tokens_per_s"] / out["off"]["gen_tokens_per_s"], 2)
    out["streams_identical"] = all(r["streams"] == runs[False][0]["streams"] for r in runs[True] + runs[False])
    return out


def run(args) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model
        if model_dir is None:
            from ringserve.tools.commands.make_tiny_model import build_tiny_model

            model_dir = str(build_tiny_model(tmp))
        bench = _Bench(model_dir, args.blocks, args.max_rows, args.prefill_budget, args.threads)
        report = {
            "setup": {
                "model": args.model or "tiny (built-in)",
                "device": "cpu",
                "torch_threads": torch.get_num_threads(),
                "block_size": 16,
                "max_rows": args.max_rows,
                "prefill_budget": args.prefill_budget,
                "kv_blocks": args.blocks,
            }
        }
        report["ttft"] = measure_ttft(bench, args.prefix, args.suffix, args.reps, args.seed)
        report["trace"] = measure_trace(
            bench, args.requests, args.share, args.system, args.max_tokens, args.seed, args.trace_reps
        )
    return report


def _table(r: dict) -> str:
    t, tr, s = r["ttft"], r["trace"], r["setup"]
    lines = [
        f"setup: {s['model']} on {s['device']}, {s['torch_threads']} torch threads, "
        f"max_rows {s['max_rows']}, prefill_budget {s['prefill_budget']}, {s['kv_blocks']} KV blocks",
        f"TTFT, {t['prompt_tokens']}-token prompt (median of {t['reps']}):",
        f"  cached prefix ({t['cached_tokens']} tokens hit)  {t['ttft_cached_ms']:>9.2f} ms",
        f"  cold prefix                     {t['ttft_cold_ms']:>9.2f} ms   ({t['ttft_speedup']}x)",
        f"trace: {tr['requests']} requests, {tr['shared_requests']} share a {tr['system_tokens']}-token "
        f"system prompt, {tr['max_tokens']} tokens each (median of {tr['reps']} runs per mode):",
    ]
    for name in ("on", "off"):
        x = tr[name]
        lines.append(
            f"  caching {name:<3}  {x['wall_s']:>7.2f} s  {x['gen_tokens_per_s']:>8.1f} tok/s  "
            f"TTFT mean {x['ttft_mean_ms']:>7.1f} ms  hit rate {x['hit_rate']:.3f}"
        )
    lines.append(f"  throughput {tr['throughput_speedup']}x; streams identical: {tr['streams_identical']}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench prefix", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--model", default=None, help="checkpoint directory (default: build the tiny model)")
    p.add_argument("--prefix", type=int, default=1500, help="cached prefix tokens in the TTFT test")
    p.add_argument("--suffix", type=int, default=20, help="uncached tail tokens in the TTFT test")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--requests", type=int, default=48, help="requests in the throughput trace")
    p.add_argument("--share", type=float, default=0.8, help="fraction of trace requests with the system prompt")
    p.add_argument("--system", type=int, default=1000, help="system prompt tokens")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument(
        "--trace-reps",
        type=int,
        default=1,
        help="trace runs per mode, on and off alternating; the median run is reported",
    )
    p.add_argument("--max-rows", type=int, default=32)
    p.add_argument("--prefill-budget", type=int, default=256)
    p.add_argument("--blocks", type=int, default=4096, help="KV blocks in the pool")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads", type=int, default=1, help="torch CPU threads (1: no oversubscription on a shared machine)"
    )
    args = p.parse_args(argv)
    if not 0.0 <= args.share <= 1.0:
        p.error("--share must be in [0, 1]")
    if (
        min(
            args.prefix,
            args.suffix,
            args.reps,
            args.requests,
            args.system,
            args.max_tokens,
            args.threads,
            args.trace_reps,
        )
        < 1
    ):
        p.error(
            "--prefix, --suffix, --reps, --trace-reps, --requests, --system, --max-tokens and --threads must be >= 1"
        )
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
