"""`ringserve bench controls [--json]`: what vLLM's logits controls and prompt scoring cost.

Sampler: one step's sampling of R rows (default 32) over a V-token vocabulary (default SmolLM2's
49,152), temperature 0.8, the rows' outputs 200 tokens long, each case against the sampler alone: the same
rows through `executor.sample_rows` asking for no control (a request that asks for none must pay
nothing), one row penalized, every row penalized (repetition, frequency, presence), and every row
with every control. Each controlled row counts one new token per step, as in serving.

Prompt scoring: one prefill step of a P-token prompt (default 256) through the model, without and
with its prompt logprobs (`--model DIR`; default: the tiny model).

Medians over `--iters` steps, the two sides of each comparison run in turn within each
iteration; each ratio is against its own baseline, measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time


def _median_ms(*fns, iters: int, warmup: int = 3) -> list[float]:
    """Median ms of each of `fns`, all run within each iteration (so drift on a shared machine
    hits them alike)."""
    times: list[list[float]] = [[] for _ in fns]
    n = len(fns)
    for i in range(warmup + iters):
        for k in range(n):  # a rotating order, so no case always follows the same other
            j = (i + k) % n
            t0 = time.perf_counter()
            fns[j]()
            if i >= warmup:
                times[j].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def bench_sampler(rows: int, vocab: int, iters: int) -> dict[str, dict[str, float]]:
    import torch

    from ringserve.gpu_proc.executor import sample_rows
    from ringserve.gpu_proc.logits_processors import ControlsState
    from ringserve.gpu_proc.sampler import sample
    from ringserve.gpu_proc.step import RowControls, RowSampling, SeqStep
    from ringserve.shm.messages import SamplingParams

    base = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    prompt = [t % vocab for t in range(100, 600)]
    penalties = SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5, presence_penalty=0.3)
    everything = SamplingParams(
        repetition_penalty=1.2,
        frequency_penalty=0.5,
        presence_penalty=0.3,
        min_p=0.05,
        logit_bias=((5, 2.0), (9, -3.0)),
        bad_words=((10, 11), (12,)),
        min_tokens=1,
    )

    def step_rows(controlled: int, settings) -> list[SeqStep]:
        out = []
        for i in range(rows):
            output = [(i * 7 + k * 13) % vocab for k in range(200)]
            controls = RowControls(settings, prompt, output) if i < controlled else None
            out.append(
                SeqStep(
                    i,
                    [output[-1]],
                    len(prompt) + len(output) - 1,
                    [0],
                    RowSampling(temperature=0.8, seed=i, controls=controls),
                )
            )
        return out

    state = ControlsState(vocab, {0}, torch.device("cpu"))

    def through_controls(batch: list[SeqStep]):
        def step():
            for s in batch:  # one new token since the last step, as a decoding row has
                seq = state.seqs.get(s.seq_id)
                if seq is not None:
                    seq.counted -= 1
            sample_rows(state, base.clone(), batch)

        return step

    plain = step_rows(0, None)
    settings = [s.sampling for s in plain if s.sampling is not None]
    alone = lambda: sample(base.clone(), settings, [s.context_len for s in plain])  # noqa: E731
    cases = {
        "through the controls, none asked for": through_controls(plain),
        f"1 of {rows} rows penalized": through_controls(step_rows(1, penalties)),
        f"{rows} of {rows} rows penalized": through_controls(step_rows(rows, penalties)),
        f"{rows} of {rows} rows, every control": through_controls(step_rows(rows, everything)),
    }
    # Each case against the sampler alone, the two in turn: the heavy cases' memory traffic would
    # otherwise blur the light ones.
    out = {}
    for name, case in cases.items():
        base_ms, case_ms = _median_ms(alone, case, iters=iters)
        out[name] = {
            "median_ms": round(case_ms, 3),
            "sampler_alone_ms": round(base_ms, 3),
            "ratio": round(case_ms / base_ms, 3),
        }
    return out


def bench_scoring(model_dir: str, prompt_len: int, iters: int) -> dict[str, float]:
    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor
    from ringserve.gpu_proc.step import PromptScoring, RowSampling, SeqStep, StepBatch

    config = Config(num_blocks=prompt_len // 16 + 4, cpu_threads=1)
    engine = build_executor(config, model_dir)
    vocab = engine.vocab_size
    ids = [(13 * k) % (vocab - 10) + 5 for k in range(prompt_len)]
    blocks = list(range(prompt_len // 16 + 1))

    def step(scored: bool):
        scoring = PromptScoring(0, ids[1:], 1) if scored else None
        batch = StepBatch([SeqStep(1, ids, 0, blocks, RowSampling(temperature=0.0), scoring)], scores_prompts=scored)
        return lambda: engine.step(batch)

    plain, scored = _median_ms(step(False), step(True), iters=iters)
    return {f"prefill {prompt_len} tokens": plain, f"prefill {prompt_len} tokens, scoring the prompt": scored}


def _with_ratios(results: dict[str, float]) -> dict[str, dict[str, float]]:
    first = next(iter(results.values()))
    return {k: {"median_ms": round(v, 3), "ratio": round(v / first, 3)} for k, v in results.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench controls", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens of the scoring step")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--model", default=None, help="checkpoint directory for the scoring step (default: the tiny model)")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the GPU process computes on the CPU (Config.cpu_threads)
    report: dict[str, dict[str, dict[str, float]]] = {"sampler": bench_sampler(args.rows, args.vocab, args.iters)}
    model = args.model
    with tempfile.TemporaryDirectory() as tmp:
        if model is None:
            from ringserve.tools.commands.make_tiny_model import build_tiny_model

            model = str(build_tiny_model(tmp))
        report["scoring"] = _with_ratios(bench_scoring(model, args.prompt, max(3, args.iters // 3)))
    if args.json:
        print(json.dumps(report))
    else:
        for table, rows in report.items():
            print(table)
            for name, r in rows.items():
                print(f"  {name:<45}{r['median_ms']:>10.3f} ms  x{r['ratio']:.2f}")
        print("(sampler: each ratio against the sampler alone, measured in turn with that case)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
