"""`ringserve bench sched`: one trace through static, dynamic, continuous and chunked batching.

Variants (the design's scheduler comparison, docs/design.md#experiments): static (row cap 32), dynamic (row cap 32, 10 ms
window), continuous (row cap 32, whole prompts), chunked (row cap 32, chunk 256), then chunked with
row caps 16 / 48 and chunks 128 / 512. Three runs of them:

1. `real`: the real engine on this machine (CPU by default) with the tiny model, on the built-in
   mix with output lengths times `--scale` (default 0.1: 1..100 tokens), prompt lengths times
   `--prompt-scale` (default 0.02: 1..160 tokens; a prompt token costs a larger share of a step on
   CPU than on the design's GPU, so prompts shrink more to keep prefill's share of the work near the
   design's) and prefill chunks times `--chunk-scale` (default 0.25: 32 / 64 / 128, so chunks still
   split the longer scaled prompts); row caps are unchanged. Time is the measured wall time of
   every pass (see `sched_sim.replay`).
2. `sim-fit`: the simulator with `step_ms = a + b*rows + c*prefill_tokens` fitted by least squares
   to the step times of run 1, on the same trace — how far the model is from the engine.
3. `sim-design`: the simulator with the design's 7B/A100 model (docs/design.md#sizing: 25 ms at 1 row, 40 ms at 32, 0.1 ms per
   prompt token), the unscaled mix and a 7,152-block pool: the design's numbers on paper.

With `--hf`, the real run also replays the trace through Hugging Face `generate` with static
batches of 32 (`hf_baseline.run_hf`) and reports ringserve's throughput ratio against it.

Output: a markdown table per run, `--json`, and with `--plot DIR` one PNG per run of throughput
against p95 TPOT.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass

from ringserve.tools.bench.batchers import ContinuousPolicy, RunToCompletionPolicy
from ringserve.tools.bench.sched_sim import DESIGN_7B_A100, EngineExecutor, SimExecutor, StepCost, replay
from ringserve.tools.harness.trace import builtin_mix, describe, poisson_arrivals, read_jsonl, scaled

DESIGN_BLOCKS = 7152


@dataclass(frozen=True, slots=True)
class Variant:
    """One scheduler configuration: `kind` static | dynamic | continuous | chunked."""

    kind: str
    max_rows: int = 32
    chunk: int | None = None
    window_ms: float = 10.0

    @property
    def label(self) -> str:
        if self.kind == "chunked":
            return f"chunked rows={self.max_rows} chunk={self.chunk}"
        if self.kind == "dynamic":
            return f"dynamic rows={self.max_rows} window={self.window_ms:g}ms"
        return f"{self.kind} rows={self.max_rows}"

    def policy(self, num_blocks: int, chunk_scale: float = 1.0):
        if self.kind == "static":
            return RunToCompletionPolicy(max_rows=self.max_rows, window_s=None, num_blocks=num_blocks)
        if self.kind == "dynamic":
            return RunToCompletionPolicy(max_rows=self.max_rows, window_s=self.window_ms / 1e3, num_blocks=num_blocks)
        if self.kind == "continuous":
            return ContinuousPolicy(max_rows=self.max_rows, prefill_budget=None, num_blocks=num_blocks)
        if self.kind == "chunked":
            if self.chunk is None:
                raise ValueError("a chunked variant needs its chunk size")
            return ContinuousPolicy(
                max_rows=self.max_rows, prefill_budget=max(1, round(self.chunk * chunk_scale)), num_blocks=num_blocks
            )
        raise ValueError(f"unknown scheduler kind {self.kind!r}")


VARIANTS = (
    Variant("static"),
    Variant("dynamic"),
    Variant("continuous"),
    Variant("chunked", chunk=256),
    Variant("chunked", max_rows=16, chunk=256),
    Variant("chunked", max_rows=48, chunk=256),
    Variant("chunked", chunk=128),
    Variant("chunked", chunk=512),
)


def run_variants(
    variants,
    trace,
    arrivals,
    make_executor,
    *,
    num_blocks: int,
    chunk_scale: float = 1.0,
    vocab: tuple[int, int] = (3, 1000),
    repeat: int = 1,
    progress=None,
) -> list[dict]:
    """Replay the trace through every variant, `repeat` rounds interleaved (so load from other
    processes falls on all variants alike); each figure is the median over the rounds. Returns one
    summary dict per variant, with every round's step samples under `_samples`."""
    if repeat < 1:
        raise ValueError(f"repeat must be >= 1, got {repeat}")
    rounds: list[list[dict]] = [[] for _ in variants]
    for _ in range(repeat):
        for v, runs in zip(variants, rounds):
            res = replay(v.policy(num_blocks, chunk_scale), trace, arrivals, make_executor(), vocab=vocab)
            runs.append(res.summary() | {"_samples": res.step_samples})
            if progress:
                progress(
                    f"{v.label}: {runs[-1]['throughput_tok_s']:.1f} tok/s, p95 TPOT {runs[-1]['tpot_p95_ms']:.1f} ms"
                )
    rows = []
    for v, runs in zip(variants, rounds):
        row = {
            k: (statistics.median(r[k] for r in runs) if isinstance(val, (int, float)) else val)
            for k, val in runs[0].items()
            if k != "_samples"
        }
        row |= {
            "label": v.label,
            "kind": v.kind,
            "max_rows": v.max_rows,
            "chunk": v.chunk,
            "rounds": repeat,
            "_samples": [s for r in runs for s in r["_samples"]],
        }
        rows.append(row)
    return rows


def markdown(rows: list[dict]) -> str:
    head = (
        "| scheduler | tok/s | p50 TTFT ms | p95 TTFT ms | p50 TPOT ms | p95 TPOT ms | p95 max gap ms "
        "| rows/step | preemptions |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} "
            f"| {r['tpot_p50_ms']:.1f} | {r['tpot_p95_ms']:.1f} | {r['max_gap_p95_ms']:.0f} "
            f"| {r['rows_per_step']:.1f} | {r['preemptions']} |"
        )
    return "\n".join(lines)


def plot(rows: list[dict], title: str, path: str) -> None:
    """Throughput against p95 TPOT, one labelled point per scheduler."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {
        "static": "tab:red",
        "dynamic": "tab:orange",
        "continuous": "tab:blue",
        "chunked": "tab:green",
        "hf": "tab:purple",
    }
    for r in rows:
        ax.scatter(r["tpot_p95_ms"], r["throughput_tok_s"], color=colors[r["kind"]], s=40)
        ax.annotate(
            r["label"], (r["tpot_p95_ms"], r["throughput_tok_s"]), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    ax.set_xlabel("p95 TPOT (ms)")
    ax.set_ylabel("throughput (output tokens/s)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _real(args, trace, arrivals, log) -> tuple[list[dict], dict]:
    import torch

    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor

    torch.set_num_threads(args.threads)
    model_dir = args.model_dir
    if model_dir is None:
        from ringserve.tools.commands.make_tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="ringserve-tiny-")))
    engine = build_executor(
        Config(device=args.device, dtype="float32", num_blocks=args.num_blocks, cpu_threads=args.threads), model_dir
    )
    vocab = (3, min(engine.vocab_size, 1000))
    rows = run_variants(
        _variants(args),
        trace,
        arrivals,
        lambda: EngineExecutor(engine),
        num_blocks=args.num_blocks,
        chunk_scale=args.chunk_scale,
        vocab=vocab,
        repeat=args.repeat,
        progress=log,
    )
    facts = {
        "device": str(engine.device),
        "model_dir": model_dir,
        "threads": args.threads,
        "num_blocks": args.num_blocks,
    }
    if args.hf:
        from ringserve.tools.bench.hf_baseline import load_hf_model, run_hf

        log(f"HF transformers generate, static batches of 32, {args.repeat} rounds ...")
        model = load_hf_model(model_dir)
        runs = [run_hf(model, trace, arrivals, batch=32, vocab=vocab).summary() for _ in range(args.repeat)]
        hf = {
            k: (statistics.median(r[k] for r in runs) if isinstance(val, (int, float)) else val)
            for k, val in runs[0].items()
        }
        hf |= {
            "label": "HF generate static batch=32",
            "kind": "hf",
            "max_rows": 32,
            "chunk": None,
            "rounds": args.repeat,
            "_samples": [],
        }
        rows.append(hf)
        ours = next(r for r in rows if r["label"] == Variant("chunked", chunk=256).label)
        facts["hf_throughput_ratio"] = ours["throughput_tok_s"] / hf["throughput_tok_s"]
        facts["hf_tpot_p95_ms"], facts["ours_tpot_p95_ms"] = hf["tpot_p95_ms"], ours["tpot_p95_ms"]
        log(f"ringserve / HF throughput: {facts['hf_throughput_ratio']:.2f}x")
    return rows, facts


def _variants(args):
    return VARIANTS[: args.limit_variants] if args.limit_variants else VARIANTS


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("_")} for r in rows]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench sched", description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=256, help="requests in the trace")
    p.add_argument(
        "--rate", type=float, default=50.0, help="Poisson arrival rate of the real/sim-fit runs, req/s (inf: a burst)"
    )
    p.add_argument("--scale", type=float, default=0.1, help="output length factor for the real run")
    p.add_argument("--prompt-scale", type=float, default=0.02, help="prompt length factor for the real run")
    p.add_argument("--chunk-scale", type=float, default=0.25, help="prefill chunk factor for the real run")
    p.add_argument("--trace", help="JSONL trace instead of the built-in mix")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", help="checkpoint directory (default: build the tiny model)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda", "auto"))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads for the real run")
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks for the real run")
    p.add_argument("--design-requests", type=int, default=300, help="requests in the 7B/A100 paper run")
    p.add_argument("--design-rate", type=float, default=1.5, help="arrival rate of the paper run (the design's plan)")
    p.add_argument("--skip-real", action="store_true", help="only the simulator with the design's paper model")
    p.add_argument("--limit-variants", type=int, default=0, help="run only the first N variants (tests)")
    p.add_argument("--repeat", type=int, default=3, help="interleaved rounds of the real run (medians reported)")
    p.add_argument("--hf", action="store_true", help="add HF transformers static batching to the real run")
    p.add_argument("--json", action="store_true", help="print JSON instead of markdown")
    p.add_argument("--plot", metavar="DIR", help="write throughput-vs-TPOT PNGs here")
    args = p.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    base = read_jsonl(args.trace) if args.trace else builtin_mix(args.requests, seed=args.seed)
    report: dict = {"runs": {}}
    if not args.skip_real:
        trace = scaled(base, args.scale, args.prompt_scale)
        arrivals = poisson_arrivals(len(trace), args.rate, seed=args.seed)
        log(
            f"real engine: {describe(trace)} at {args.rate} req/s (outputs x{args.scale}, prompts "
            f"x{args.prompt_scale}, chunks x{args.chunk_scale})"
        )
        real, facts = _real(args, trace, arrivals, log)
        samples = [s for r in real for s in r["_samples"]]  # the HF row has none
        cost = StepCost.fit(samples)
        fit = {
            "model": cost.describe(),
            "a_ms": cost.a_ms,
            "b_ms": cost.b_ms,
            "c_ms": cost.c_ms,
            "r_squared": cost.r_squared(samples),
            "steps": len(samples),
        }
        log(f"fit over {len(samples)} steps: {cost.describe()} (R^2 {fit['r_squared']:.3f})")
        simfit = run_variants(
            _variants(args),
            trace,
            arrivals,
            lambda: SimExecutor(cost),
            num_blocks=args.num_blocks,
            chunk_scale=args.chunk_scale,
        )
        report["runs"]["real"] = {
            "trace": describe(trace),
            "rate": args.rate,
            "scale": args.scale,
            "prompt_scale": args.prompt_scale,
            "chunk_scale": args.chunk_scale,
            **facts,
            "rows": _strip(real),
        }
        report["runs"]["sim-fit"] = {"trace": describe(trace), "rate": args.rate, "fit": fit, "rows": _strip(simfit)}
    design_trace = builtin_mix(args.design_requests, seed=args.seed) if not args.trace else base
    design_arr = poisson_arrivals(len(design_trace), args.design_rate, seed=args.seed)
    paper = run_variants(
        _variants(args), design_trace, design_arr, lambda: SimExecutor(DESIGN_7B_A100), num_blocks=DESIGN_BLOCKS
    )
    report["runs"]["sim-design"] = {
        "trace": describe(design_trace),
        "rate": args.design_rate,
        "model": DESIGN_7B_A100.describe(),
        "num_blocks": DESIGN_BLOCKS,
        "rows": _strip(paper),
    }
    if args.plot:
        import os

        os.makedirs(args.plot, exist_ok=True)
        for name, run in report["runs"].items():
            path = os.path.join(args.plot, f"sched-{name}-r{run['rate']:g}.png")
            plot(run["rows"], f"bench sched ({name}) at {run['rate']} req/s\n{run['trace']}", path)
            run["plot"] = path
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        for name, run in report["runs"].items():
            extra = run.get("fit", {}).get("model") or run.get("model") or f"device {run.get('device')}"
            print(f"\n### {name}: {run['trace']} at {run['rate']} req/s ({extra})\n")
            print(markdown(run["rows"]))
            if "hf_throughput_ratio" in run:
                print(
                    f"\nringserve (chunked rows=32 chunk=256) / HF generate throughput: "
                    f"{run['hf_throughput_ratio']:.2f}x; p95 TPOT {run['ours_tpot_p95_ms']:.1f} ms vs "
                    f"{run['hf_tpot_p95_ms']:.1f} ms"
                )
    return 0


if __name__ == "__main__":
    sys.exit(main())
