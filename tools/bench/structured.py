"""`ringserve bench structured [--json]`: what grammar-constrained decoding costs a decode step.

One decode step of R rows (default 32) through the real engine (`Executor.step`: the grammar
thread's mask fill, the forward, the controls and the sampler), each row a sequence that keeps
growing as it samples, on the mid-size random Llama and on SmolLM2 (`--smollm2 DIR`, default
its converted checkpoint when present). Cases, each against its own baseline measured in the same
iterations:
- 0 of R rows constrained, through `Executor.step`, against the forward and the sampler called
  directly (the step as it was before structured output): what unconstrained rows pay (goal <= 1.02x);
- 1 of R and R of R rows constrained by a JSON schema, against the same batch unconstrained
  (goal for R of R: <= 1.15x);
- the mask fill alone (sync each matcher with its new token, fill the bitmask, unpack it), per
  row per token, for 1 and R rows.

The rows sample at temperature 0.8 with a seed; a constrained row's grammar (an array of objects
with string fields, at least 100 of them) never completes within the run, so every step fills a real mask. Medians over
`--iters` steps, the cases of a comparison run in turn within each iteration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "note": {"type": "string"}},
        "required": ["name", "city", "note"],
        "additionalProperties": False,
    },
    "minItems": 100,
}
PROMPT = 16


class _Batch:
    """R growing sequences (fresh seq ids), prefilled, each step one decode row per sequence."""

    def __init__(self, engine, first_id: int, rows: int, constrained: int, grammar: str, blocks_each: int) -> None:
        from ringserve.gpu_proc.step import RowControls, RowSampling, SeqStep, StepBatch
        from ringserve.shm.messages import SamplingParams

        self.engine = engine
        vocab = engine.vocab_size
        plain = SamplingParams(temperature=0.8)
        shaped = SamplingParams(temperature=0.8, grammar=grammar)
        self.outputs: list[list[int]] = [[] for _ in range(rows)]
        self.seqs = []
        for i in range(rows):
            prompt = [(31 * i + 7 * k) % (vocab - 10) + 5 for k in range(PROMPT)]
            sp = shaped if i < constrained else plain
            controls = RowControls(sp, prompt, self.outputs[i]) if sp.controlled else None
            table = list(range((first_id + i) * blocks_each, (first_id + i + 1) * blocks_each))
            sampling = RowSampling(temperature=0.8, seed=i, sample_index=0, controls=controls)
            self.seqs.append(SeqStep(first_id + i, prompt, 0, table, sampling))
            if sp.grammar is not None:
                engine.grammar.compiler.wait(sp.grammar)
        self.StepBatch = StepBatch
        self._advance(engine.step(StepBatch(self.seqs)))  # the prefill of every row

    def _advance(self, out) -> None:
        for s, out_list, tok in zip(self.seqs, self.outputs, out.token_ids):
            s.start_pos += len(s.token_ids)
            s.token_ids = [tok]
            out_list.append(tok)

    def step(self) -> None:
        self._advance(self.engine.step(self.StepBatch(self.seqs)))

    def step_without_grammar_hook(self) -> None:
        """The forward and the sampler alone, as `Executor.step` was before structured output."""
        from ringserve.gpu_proc.executor import sample_rows

        eng = self.engine
        batch = self.StepBatch(self.seqs)
        logits = eng.runner.execute(batch)
        self._advance(sample_rows(eng.controls, logits[: len(self.seqs)], self.seqs))

    def fill_only(self) -> None:
        """The grammar side of a step alone: sync, fill, unpack (the rows' next token appended)."""
        masks = self.engine.grammar.begin(self.seqs)
        if masks is not None:
            masks.allowed()


def _median_ms(*fns, iters: int, warmup: int = 3) -> list[float]:
    times: list[list[float]] = [[] for _ in fns]
    for i in range(warmup + iters):
        for k in range(len(fns)):
            j = (i + k) % len(fns)
            t0 = time.perf_counter()
            fns[j]()
            if i >= warmup:
                times[j].append((time.perf_counter() - t0) * 1e3)
    return [statistics.median(t) for t in times]


def bench_model(model_dir: str, rows: int, iters: int, device: str) -> dict:
    import llguidance

    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor

    steps = 3 + iters + 2
    blocks_each = (PROMPT + steps * 2) // 16 + 2
    config = Config(num_blocks=blocks_each * rows * 6 + 8, cpu_threads=1, device=device)
    engine = build_executor(config, model_dir)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(
        SCHEMA, defaults={"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    )
    ids = iter(range(0, 6 * rows, rows))

    def batch(constrained: int) -> _Batch:
        return _Batch(engine, next(ids), rows, constrained, grammar, blocks_each)

    plain, none_through, one, every = batch(0), batch(0), batch(1), batch(rows)
    before, hooked = _median_ms(plain.step_without_grammar_hook, none_through.step, iters=iters)
    base, one_ms, all_ms = _median_ms(plain.step, one.step, every.step, iters=iters)
    fill_one, fill_all = batch(1), batch(rows)
    # NOTE: fill-only batches do not sample; each fill consumes the next token of a real answer
    # (taken from the constrained batches' outputs, which the grammar accepted).
    answers = every.outputs

    def replay(b: _Batch):
        def run():
            for i, out in enumerate(b.outputs):
                src = answers[i % rows]
                if len(out) < len(src):
                    out.append(src[len(out)])
            b.fill_only()

        return run

    for b in (fill_one, fill_all):
        for i, out in enumerate(b.outputs):
            out[:] = answers[i % rows][:1]
    f1, fr = _median_ms(replay(fill_one), replay(fill_all), iters=min(iters, len(answers[0]) - 6))
    engine.grammar.close()
    return {
        f"0 of {rows} constrained, vs the step without the grammar hook": _case(hooked, before),
        f"1 of {rows} constrained, vs unconstrained": _case(one_ms, base),
        f"{rows} of {rows} constrained, vs unconstrained": _case(all_ms, base),
        "mask fill per row per token (1 row), us": round(f1 * 1e3, 1),
        f"mask fill per row per token ({rows} rows), us": round(fr * 1e3 / rows, 1),
        "vocab": engine.vocab_size,
    }


def _case(ms: float, base: float) -> dict[str, float]:
    return {"median_ms": round(ms, 3), "baseline_ms": round(base, 3), "ratio": round(ms / base, 3)}


def _default_smollm2() -> str | None:
    from ringserve import models

    path = models.known_model_dir(models.DEFAULT_MODEL)
    return str(path) if models.is_converted(path) else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench structured", description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--rows", type=int, default=32)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cpu", help="cpu | cuda | auto")
    p.add_argument("--smollm2", default=None, help="SmolLM2 checkpoint directory (default: the converted one)")
    p.add_argument("--skip-mid", action="store_true", help="only SmolLM2")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(1)  # as the GPU process computes on the CPU (Config.cpu_threads)
    report: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        if not args.skip_mid:
            from ringserve.tools.commands.make_tiny_model import TinyModelSpec, build_tiny_model

            spec = TinyModelSpec(
                num_layers=6, hidden_size=384, num_heads=6, num_kv_heads=2, intermediate_size=1024, seed=2
            )
            mid = build_tiny_model(Path(tmp) / "mid", spec)
            report["mid model"] = bench_model(str(mid), args.rows, args.iters, args.device)
        smol = args.smollm2 or _default_smollm2()
        if smol is not None:
            report["SmolLM2-135M"] = bench_model(smol, args.rows, args.iters, args.device)
    report["device"] = {"name": args.device}
    if args.json:
        print(json.dumps(report))
    else:
        for model, rows in report.items():
            print(model)
            for name, r in rows.items():
                if isinstance(r, dict):
                    print(f"  {name:<60}{r['median_ms']:>10.3f} ms  x{r['ratio']:.3f}")
                else:
                    print(f"  {name:<60}{r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
