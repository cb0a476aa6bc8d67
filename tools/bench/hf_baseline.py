"""The baseline users would otherwise pick — Hugging Face transformers `generate` with static
batching — against ringserve's engine, on the same trace, model and machine, in the same run.
Run it as `python -m ringserve.tools.bench.hf_baseline`, or as part of `ringserve bench sched --hf`.

Both sides replay the trace on a virtual clock (requests arrive at their Poisson offsets; the clock
advances by measured compute time and jumps over idle gaps), so neither pays for the other's time:

- HF: a batch forms when `--batch` requests wait (or no more will come); prompts are left-padded;
  `LlamaForCausalLM.generate` runs greedily with `min_new_tokens = max_new_tokens` = the batch's
  longest answer (EOS off, so lengths replay exactly); a streamer stamps every decoding step. A
  request's TTFT is its wait plus the time to the batch's first token; its TPOT is
  (its last token - its first) / (tokens - 1), its last token being step `output_tokens`.
- ringserve: the product's scheduler (continuous batching, chunked prefill) over the real model
  runner and sampler (`sched_sim.replay` with `EngineExecutor`), row cap = `--batch`.

The goal from issue 8: ringserve >= 3x HF's throughput at equal or lower p95 TPOT.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

from ringserve.tools.bench.sched_sim import EngineExecutor, ReplayResult, prompt_ids_for, replay
from ringserve.tools.harness.trace import TraceRequest, builtin_mix, describe, poisson_arrivals, read_jsonl, scaled


class _StepClock:
    """A transformers streamer that only records when each generated step's tokens appear."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value) -> None:
        if not self._prompt_seen:  # generate() first hands the streamer the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def load_hf_model(model_dir: str):
    import transformers
    from transformers import LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype="float32")
    model.eval()
    return model


def run_hf(
    model,
    trace: list[TraceRequest],
    arrivals: list[float],
    *,
    batch: int,
    vocab: tuple[int, int] = (3, 1000),
    pad_token_id: int = 0,
) -> ReplayResult:
    """Static batches through `model.generate` on a virtual clock (see the module doc)."""
    import torch

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    order = sorted(range(len(trace)), key=lambda i: arrivals[i])
    ttft, tpot, gaps = [0.0] * len(trace), [], [0.0] * len(trace)
    done_at = [0.0] * len(trace)
    now, k, steps, rows_total, tokens = 0.0, 0, 0, 0, 0
    while k < len(order):
        # Static batching: wait for a full batch, or for the last arrival when fewer remain.
        members = order[k : k + batch]
        now = max(now, arrivals[members[-1]])
        k += len(members)
        prompts = [prompt_ids_for(i, trace[i].prompt_tokens, vocab) for i in members]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[pad_token_id] * (width - len(p)) + p for p in prompts])  # [batch, width], left-padded
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        longest = max(trace[i].output_tokens for i in members)
        clock = _StepClock()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=longest,
                min_new_tokens=longest,
                do_sample=False,
                pad_token_id=pad_token_id,
                streamer=clock,
            )
        elapsed = time.perf_counter() - t0
        if out.shape[1] - width != longest or len(clock.times) != longest:
            raise RuntimeError(
                f"generate made {out.shape[1] - width} tokens ({len(clock.times)} steps), asked for {longest}"
            )
        stamps = [now + (t - t0) for t in clock.times]  # virtual time of each step's tokens
        for i in members:
            want = trace[i].output_tokens
            ttft[i] = stamps[0] - arrivals[i]
            if want > 1:
                tpot.append((stamps[want - 1] - stamps[0]) / (want - 1))
                gaps[i] = max(b - a for a, b in zip(stamps[:want], stamps[1:want]))
            done_at[i] = stamps[want - 1]
            tokens += want
        now += elapsed
        steps += longest
        rows_total += longest * len(members)
    start = min(arrivals) if arrivals else 0.0
    return ReplayResult(
        name=f"hf-static-{batch}",
        ttft_s=ttft,
        tpot_s=tpot,
        max_gap_s=gaps,
        output_tokens=tokens,
        makespan_s=max(done_at, default=start) - start,
        steps=steps,
        preemptions=0,
        rows_per_step=rows_total / max(steps, 1),
    )


def compare(
    model_dir: str,
    trace: list[TraceRequest],
    arrivals: list[float],
    *,
    batch: int,
    chunk: int,
    num_blocks: int = 4096,
    threads: int = 1,
) -> dict:
    """Both systems on the same trace in this process; returns both summaries and the ratios."""
    import torch

    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor
    from ringserve.tools.bench.batchers import ContinuousPolicy

    torch.set_num_threads(threads)  # HF's generate below runs with the same thread count
    engine = build_executor(  # the float weights HF's generate runs, not a converted GGUF's blocks
        Config(device="cpu", dtype="float32", num_blocks=num_blocks, cpu_threads=threads, quantization="none"),
        model_dir,
    )
    vocab = (3, min(engine.vocab_size, 1000))
    ours = replay(
        ContinuousPolicy(max_rows=batch, prefill_budget=chunk, num_blocks=num_blocks),
        trace,
        arrivals,
        EngineExecutor(engine),
        vocab=vocab,
    ).summary()
    hf = run_hf(load_hf_model(model_dir), trace, arrivals, batch=batch, vocab=vocab).summary()
    ours["name"] = f"ringserve chunked rows={batch} chunk={chunk}"
    ratio = ours["throughput_tok_s"] / hf["throughput_tok_s"] if hf["throughput_tok_s"] else float("inf")
    return {
        "ringserve": ours,
        "hf": hf,
        "throughput_ratio": ratio,
        "goal_met": ratio >= 3.0 and ours["tpot_p95_ms"] <= hf["tpot_p95_ms"],
    }


def markdown(result: dict) -> str:
    lines = [
        "| system | tok/s | p50 TTFT ms | p95 TTFT ms | p50 TPOT ms | p95 TPOT ms | rows/step |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for key in ("ringserve", "hf"):
        r = result[key]
        lines.append(
            f"| {r['name']} | {r['throughput_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} | {r['ttft_p95_ms']:.0f} "
            f"| {r['tpot_p50_ms']:.1f} | {r['tpot_p95_ms']:.1f} | {r['rows_per_step']:.1f} |"
        )
    lines.append("")
    lines.append(
        f"Throughput ratio ringserve / HF: {result['throughput_ratio']:.2f}x; goal (>= 3x at equal or "
        f"lower p95 TPOT) {'met' if result['goal_met'] else 'NOT met'}."
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m ringserve.tools.bench.hf_baseline", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--model-dir", help="checkpoint directory (default: build the tiny model)")
    p.add_argument("--requests", type=int, default=192)
    p.add_argument(
        "--rate",
        type=float,
        default=float("inf"),
        help="Poisson arrival rate, req/s (default inf: a burst, which measures capacity)",
    )
    p.add_argument("--scale", type=float, default=0.1, help="output length factor (CPU)")
    p.add_argument("--prompt-scale", type=float, default=0.02, help="prompt length factor (CPU; see bench sched)")
    p.add_argument("--trace", help="JSONL trace instead of the built-in mix")
    p.add_argument("--batch", type=int, default=32, help="HF static batch size = ringserve row cap")
    p.add_argument("--chunk", type=int, default=64, help="ringserve prefill chunk (bench sched's scaled 256)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (both systems)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    model_dir = args.model_dir
    if model_dir is None:
        from ringserve.tools.commands.make_tiny_model import build_tiny_model

        model_dir = str(build_tiny_model(tempfile.mkdtemp(prefix="ringserve-tiny-")))
    base = read_jsonl(args.trace) if args.trace else builtin_mix(args.requests, seed=args.seed)
    trace = scaled(base, args.scale, args.prompt_scale)
    arrivals = poisson_arrivals(len(trace), args.rate, seed=args.seed)
    print(
        f"trace: {describe(trace)} at {args.rate} req/s (outputs x{args.scale}, prompts x{args.prompt_scale})",
        file=sys.stderr,
    )
    result = compare(model_dir, trace, arrivals, batch=args.batch, chunk=args.chunk, threads=args.threads)
    result |= {
        "trace": describe(trace),
        "rate": args.rate,
        "scale": args.scale,
        "prompt_scale": args.prompt_scale,
        "model_dir": model_dir,
        "threads": args.threads,
    }
    print(json.dumps(result, indent=2) if args.json else markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
