"""`ringserve bench step [--json] [--device cpu|cuda]`: where one engine step's time goes.

Each step is a decode step of R rows (R = 1, 8, 32, 256) with mixed contexts (about 500 tokens,
33 blocks each) and mixed sampling settings (a quarter each greedy, temperature, top-k, top-p),
split into phases:

- prepare: building the step's index tensors from the step description (`ModelRunner.prepare`);
- forward: the model (`ModelRunner.forward`);
- sample: the sampler's tensor math (`sampler.sample_tensors`) — device compute, reported apart;
- other: the sampler's host halves (`plan_sampling`, `to_output`) and the loop's bookkeeping per row:
  the stop check and the `Token` record for the worker.

Host overhead = prepare + other: Python work per step outside the forward and the sampler math.
Models: the tiny checkpoint (real forward; `--model` for another, `--dtype`, and `--reference` to
run it beside itself on the torch reference path, CPU kernels off), and a null model with a
32,000-token vocabulary whose forward returns precomputed logits at once, which exposes the host
overhead ("null": LM-like peaked logits; "flat": pure noise, the sampler's worst case for top-p).
On CUDA every phase ends with a synchronize so its device time is its own. Figures are medians
over `--iters` steps.

With `--cuda-graphs on` (CUDA) the model's decode steps replay captured graphs: their "forward" is
the replay including the copy of the step into the graph's static buffers, and "prepare" is 0.
`--load-format dummy --model DIR` benchmarks a real model's shape with random weights
(`ringserve make-dummy-model llama-3-8b DIR`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from typing import TYPE_CHECKING, cast

GOALS_MS = {32: 0.3, 256: 1.0}  # host overhead goals from the engine issue

if TYPE_CHECKING:
    import torch


class NullModel:
    """A model whose forward returns precomputed logits `[R, vocab]`: no device work at all.

    The logits look like a language model's: a few tokens per row stand well above a noisy floor,
    so top-p nuclei are tens of tokens. (`flat=True` gives pure noise, whose top-p nuclei are
    thousands of tokens wide: the sampler's worst case, reported as `sample_ms_*_flat`.)
    """

    def __init__(self, vocab: int, max_rows: int, device, flat: bool = False):
        import torch

        gen = torch.Generator().manual_seed(0)
        logits = torch.randn(max_rows, vocab, generator=gen) * 2
        if not flat:
            peaks = torch.randint(0, vocab, (max_rows, 8), generator=gen)
            logits.scatter_add_(1, peaks, 14 + 6 * torch.rand(max_rows, 8, generator=gen))
        self.logits = logits.to(device)

    def __call__(self, input_ids, meta, kv_pool, logits_indices):
        return self.logits[: logits_indices.shape[0]]


def _rows_sampling(n: int):
    from ringserve.gpu_proc.step import RowSampling

    kinds = [
        RowSampling(temperature=0.0),
        RowSampling(temperature=0.8, seed=1),
        RowSampling(temperature=0.7, top_k=40, seed=2),
        RowSampling(temperature=1.0, top_p=0.9, seed=3),
    ]
    return [kinds[i % 4] for i in range(n)]


def _decode_batch(rows: int, block_size: int, draft: int = 0):
    """`rows` decode rows, each with `draft` speculative tokens to verify after its own."""
    from ringserve.gpu_proc.step import SeqStep, StepBatch

    samplings = _rows_sampling(rows)
    seqs = []
    for i in range(rows):
        ctx = 500 + (i * 7) % 31  # cached tokens before this step
        nblocks = (ctx + 1 + draft + block_size - 1) // block_size
        table = [(i * 64 + j) for j in range(nblocks)]
        seqs.append(SeqStep(i, [17 + i % 100] + [18 + j for j in range(draft)], ctx, table, samplings[i], draft=draft))
    return StepBatch(seqs, has_drafts=draft > 0)


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(runner, rows: int, iters: int, warmup: int = 3, draft: int = 0) -> dict[str, float]:
    """Median milliseconds per phase of a `rows`-row decode step (each row verifying `draft`
    speculative tokens too)."""
    from ringserve.gpu_proc.sampler import plan_sampling, sample_tensors, to_output
    from ringserve.rules import finish_reason
    from ringserve.shm.messages import Token

    batch = _decode_batch(rows, runner.block_size, draft)
    device = runner.device
    eos = frozenset({1})
    phases: dict[str, list[float]] = {"prepare": [], "forward": [], "sample": [], "other": []}
    clock = time.perf_counter
    graphs = getattr(runner, "graphs", None)
    graph_size = graphs.size_for(batch) if graphs is not None else None
    for it in range(warmup + iters):
        _sync(device)
        t0 = clock()
        if graph_size is None:
            inputs = runner.prepare(batch)
            _sync(device)
            t1 = clock()
            logits = runner.forward(inputs)
        else:  # the replay copies the step into the graph's static buffers itself
            t1 = t0
            logits = runner.execute(batch)
        _sync(device)
        t2 = clock()
        samplers = batch.sampling_rows
        plan = plan_sampling([s.sampling for s in samplers], [s.context_len for s in samplers], device)
        _sync(device)
        t3 = clock()
        result = sample_tensors(logits, plan)
        _sync(device)
        t4 = clock()
        out = to_output(plan, *result)
        records = []
        for s, tok, lp in zip(samplers, out.token_ids, out.logprobs):
            finish_reason(tok, 1, s.context_len + 1, eos_token_ids=eos, max_tokens=1000, context_limit=8192)
            records.append(Token(s.seq_id, 0, tok, lp))
        t5 = clock()
        if it >= warmup:
            phases["prepare"].append(t1 - t0)
            phases["forward"].append(t2 - t1)
            phases["sample"].append(t4 - t3)
            phases["other"].append((t3 - t2) + (t5 - t4))
    res = {k: statistics.median(v) * 1e3 for k, v in phases.items()}
    res["host_overhead"] = res["prepare"] + res["other"]
    # The fastest step's host work: what the code costs when the CPU is not shared (CI machines are).
    res["host_overhead_min"] = min(a + b for a, b in zip(phases["prepare"], phases["other"])) * 1e3
    res["total"] = res["prepare"] + res["forward"] + res["sample"] + res["other"]
    return res


def _model_runner(
    model_dir: str,
    device,
    max_rows: int,
    load_format: str = "auto",
    dtype: str = "auto",
    cuda_graphs: bool = False,
    cpu_kernels: bool = True,
    quantization: str = "auto",  # the bench compares against "none" itself (--dequantized)
):
    from ringserve.config import Config
    from ringserve.gpu_proc.executor import served_kv_dtype
    from ringserve.gpu_proc.kv_pool import KVPool
    from ringserve.gpu_proc.model.loader import load_model
    from ringserve.gpu_proc.model_runner import ModelRunner
    from ringserve.gpu_proc.warmup import warm_up

    model = load_model(model_dir, device, dtype, load_format, cpu_kernels=cpu_kernels, quantization=quantization)
    a = model.args
    kv = served_kv_dtype(Config(), model, cpu_kernels)  # the cache a server gives this model
    runner = ModelRunner(
        model, KVPool(a.num_layers, max_rows * 64, a.num_kv_heads, a.head_dim, dtype=kv, device=device)
    )
    warm_up(runner)  # kernels compiled and first-use costs paid outside the timed steps
    if cuda_graphs and device.type == "cuda":
        from ringserve.gpu_proc.cuda_graphs import DecodeGraphs

        graphs = DecodeGraphs(runner, max_rows, context_limit=1024)  # the bench contexts are ~530
        graphs.capture_all()
        runner.graphs = graphs
    return runner


def _null_runner(device, max_rows: int, flat: bool = False):
    from ringserve.gpu_proc.kv_pool import KVPool
    from ringserve.gpu_proc.model_runner import ModelRunner

    model = cast("torch.nn.Module", NullModel(32000, max_rows, device, flat))  # a forward, no weights
    return ModelRunner(model, KVPool(1, max_rows * 64, 1, 8, device=device))


def run(
    device_name: str,
    rows_list: list[int],
    iters: int,
    model_dir: str | None,
    warmup: int = 3,
    load_format: str = "auto",
    dtype: str = "auto",
    cuda_graphs: bool = False,
    reference: bool = False,
    drafts: tuple[int, ...] = (),
    dequantized: bool = False,
) -> dict:
    import torch

    if device_name == "cuda" and not torch.cuda.is_available():
        raise SystemExit("ringserve bench step: --device cuda but no CUDA device is available")
    device = torch.device(device_name)
    if device.type == "cpu":
        from ringserve.config import Config
        from ringserve.gpu_proc.cpu_tuning import tune_cpu_process

        tune_cpu_process(Config().cpu_threads)  # what the GPU process does on the CPU
    max_rows = max(rows_list)
    report: dict = {
        "device": device_name,
        "iters": iters,
        "rows": rows_list,
        "goals_ms": GOALS_MS,
        "load_format": load_format,
        "cuda_graphs": cuda_graphs and device.type == "cuda",
        "models": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        if model_dir is None:
            from ringserve.tools.commands.make_tiny_model import build_tiny_model

            model_dir = str(build_tiny_model(tmp))
        runners = {"tiny": _model_runner(model_dir, device, max_rows, load_format, dtype, cuda_graphs)}
        if reference:  # the same model on the torch reference path (CPU kernels off), in the same run
            runners["tiny_ref"] = _model_runner(model_dir, device, max_rows, load_format, dtype, cpu_kernels=False)
        if dequantized:  # a converted GGUF's weights dequantized (--quantization none), in the same run
            runners["tiny_none"] = _model_runner(model_dir, device, max_rows, load_format, dtype, quantization="none")
        report["kv_cache_dtype"] = {n: str(r.kv_pool.dtype).removeprefix("torch.") for n, r in runners.items()}
        runners |= {"null": _null_runner(device, max_rows), "flat": _null_runner(device, max_rows, flat=True)}
        for name, runner in runners.items():
            report["models"][name] = {str(r): measure(runner, r, iters, warmup) for r in rows_list}
        # speculative decoding: the same steps with each row verifying d draft tokens (rows "R+d"),
        # where the step turns from reading weights to computing (docs/BENCHMARKS.md)
        for d in drafts:
            for r in rows_list:
                report["models"]["tiny"][f"{r}+{d}"] = measure(runners["tiny"], r, iters, warmup, d)
    for r in rows_list:
        null = report["models"]["null"][str(r)]
        report[f"host_overhead_ms_{r}"] = round(null["host_overhead"], 4)
        report[f"host_overhead_min_ms_{r}"] = round(null["host_overhead_min"], 4)
        report[f"sample_ms_{r}"] = round(null["sample"], 4)
        report[f"prepare_ms_{r}"] = round(null["prepare"], 4)
        report[f"sample_ms_{r}_flat"] = round(report["models"]["flat"][str(r)]["sample"], 4)
        report[f"forward_ms_tiny_{r}"] = round(report["models"]["tiny"][str(r)]["forward"], 4)
        if reference:
            report[f"forward_ms_tiny_ref_{r}"] = round(report["models"]["tiny_ref"][str(r)]["forward"], 4)
    return report


def _table(report: dict) -> str:
    lines = [f"device {report['device']}, median of {report['iters']} steps, ms per step"]
    lines.append(
        f"{'model':<6}{'rows':>6}{'prepare':>10}{'forward':>10}{'sample':>10}{'other':>10}{'host ovh':>10}{'total':>10}"
    )
    for name, by_rows in report["models"].items():
        for r, m in by_rows.items():
            lines.append(
                f"{name:<6}{r:>6}{m['prepare']:>10.3f}{m['forward']:>10.3f}{m['sample']:>10.3f}"
                f"{m['other']:>10.3f}{m['host_overhead']:>10.3f}{m['total']:>10.3f}"
            )
    for r, goal in GOALS_MS.items():
        if f"host_overhead_ms_{r}" in report:
            got = report[f"host_overhead_ms_{r}"]
            best = report[f"host_overhead_min_ms_{r}"]
            lines.append(
                f"host overhead at {r} rows: median {got:.3f} ms, best {best:.3f} ms (goal <= {goal} ms): "
                f"{'ok' if got <= goal else 'OVER'}"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench step", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--rows", default="1,8,32,256", help="comma-separated row counts")
    p.add_argument("--iters", type=int, default=20, help="measured steps per point")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps before each point")
    p.add_argument("--model", default=None, help="checkpoint directory (default: build the tiny model)")
    p.add_argument(
        "--load-format",
        choices=("auto", "dummy"),
        default="auto",
        help="dummy: random weights of --model's shape (no weight files)",
    )
    p.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "float32", "bfloat16", "float16"),
        help="the model's dtype (auto: the checkpoint's; float32 on CPU for half-precision ones)",
    )
    p.add_argument("--cuda-graphs", choices=("on", "off"), default="off", help="replay decode steps from CUDA graphs")
    p.add_argument(
        "--draft", default="", help="comma-separated draft lengths: also time each row verifying that many tokens"
    )
    p.add_argument(
        "--reference",
        action="store_true",
        help="also run the model on the torch reference path (CPU kernels off): 'tiny_ref' rows",
    )
    p.add_argument(
        "--dequantized",
        action="store_true",
        help="also run a converted GGUF's model with every weight dequantized (--quantization none): 'tiny_none' rows",
    )
    args = p.parse_args(argv)
    try:
        rows = sorted({int(x) for x in args.rows.split(",") if x.strip()})
    except ValueError:
        p.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if not rows or rows[0] <= 0 or args.iters <= 0 or args.warmup < 0:
        p.error("--rows must be positive integers, --iters > 0 and --warmup >= 0")
    try:
        drafts = tuple(sorted({int(x) for x in args.draft.split(",") if x.strip()}))
    except ValueError:
        p.error(f"--draft must be comma-separated integers, got {args.draft!r}")
    if drafts and drafts[0] <= 0:
        p.error("--draft lengths must be > 0")
    report = run(
        args.device,
        rows,
        args.iters,
        args.model,
        args.warmup,
        args.load_format,
        args.dtype,
        args.cuda_graphs == "on",
        args.reference,
        drafts,
        args.dequantized,
    )
    print(json.dumps(report, indent=2) if args.json else _table(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
