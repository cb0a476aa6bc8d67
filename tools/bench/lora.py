"""`ringserve bench lora [--json]`: decode throughput with LoRA adapters mixed in the rows against
the base model alone, on the same engine (gpu_proc/lora.py), and what swapping adapters costs.

`--streams` requests of `--tokens` tokens each (EOS ignored) run through the real scheduler and
executor (the offline engine: no HTTP) three ways, in alternating order for `--repeats` rounds:
`base` (every request on the base model), `mixed` (the requests spread over `--adapters` adapters
of rank `--rank` on every projection, all resident) and `swap` (spread over twice as many adapters
as the `--adapters` resident slots, so the scheduler holds some back and the registry copies them
in). Reported: tokens/s of each, the medians of mixed / base and swap / base, the swaps, and the
time one slot fill takes. The adapters are random (A and B normal, scaled 1 / rank) in PEFT's saved
format. The goal (issue 36): mixed / base >= 0.8 at 32 streams; exits 1 when it fails.
One torch thread, the CPU.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

GOAL = 0.8
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, args, rank: int, seed: int, alpha: float | None = None) -> Path:
    """A random LoRA adapter on every projection of a model of `args`, as PEFT saves one: each
    delta about as large as its projection's input times `alpha / rank` (default 1)."""
    import torch
    from safetensors.torch import save_file

    from ringserve.gpu_proc.lora import GROUPS, projection_shapes

    gen = torch.Generator().manual_seed(seed)
    shapes, tensors = projection_shapes(args), {}
    for layer in range(args.num_layers):
        for module in (m for ms in GROUPS.values() for m in ms):
            fan_in, fan_out = shapes[module]
            key = f"base_model.model.model.layers.{layer}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) / rank
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": rank if alpha is None else alpha,
        "target_modules": list(TARGETS),
        "bias": "none",
    }
    (directory / "adapter_config.json").write_text(json.dumps(config))
    return directory


def _runner(directory: Path, adapters: dict[str, Path], slots: int, rank: int, blocks: int):
    from ringserve.gpu_proc.kv_pool import KVPool
    from ringserve.gpu_proc.lora import LoraRegistry
    from ringserve.gpu_proc.model.loader import load_model
    from ringserve.gpu_proc.model_runner import ModelRunner

    model = load_model(directory, "cpu")
    a = model.args
    loras = LoraRegistry(a, slots, rank, model.device, model.dtype)
    for name, path in adapters.items():
        loras.load(name, path)
    return ModelRunner(model, KVPool(a.num_layers, blocks, a.num_kv_heads, a.head_dim), loras)


def _tok_s(runner, prompts: list[list[int]], loras: list[str | None], tokens: int, streams: int) -> float:
    from ringserve.gpu_proc.offline import OfflineRequest, generate
    from ringserve.shm.messages import SamplingParams

    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [
        OfflineRequest(prompt_ids=prompts[i % len(prompts)], max_tokens=tokens, sampling=greedy, lora=loras[i])
        for i in range(streams)
    ]
    start = time.perf_counter()
    out = generate(runner, reqs, eos_token_ids=frozenset(), max_rows=streams)
    return sum(len(r.token_ids) for r in out) / (time.perf_counter() - start)


def measure(model: str | None, streams: int, tokens: int, adapters: int, rank: int, repeats: int) -> dict:
    import torch
    from tokenizers import Tokenizer

    from ringserve import models

    directory = models.ensure(model).directory
    codec = Tokenizer.from_file(str(directory / "tokenizer.json"))
    prompts = [codec.encode(p).ids for p in ("The capital of France is", "def fibonacci(n):", "Once upon a time,")]
    with tempfile.TemporaryDirectory() as tmp:
        args = _runner(directory, {}, 1, rank, 16).model.args
        paths = {f"a{i}": write_adapter(Path(tmp) / f"a{i}", args, rank, i) for i in range(2 * adapters)}
        blocks = streams * ((max(map(len, prompts)) + tokens) // 16 + 2)
        runner = _runner(directory, paths, adapters, rank, blocks)
        names = list(paths)
        ways: dict[str, list[str | None]] = {
            "base": [None] * streams,
            "mixed": [names[i % adapters] for i in range(streams)],
            "swap": [names[i % (2 * adapters)] for i in range(streams)],
        }
        rates: dict[str, list[float]] = {w: [] for w in ways}
        _tok_s(runner, prompts, ways["mixed"], 4, streams)  # warm: oneDNN primitives, slots filled
        swaps_before = runner.loras.swaps
        for k in range(repeats):
            order = list(ways) if k % 2 == 0 else list(reversed(ways))
            for way in order:
                rates[way].append(_tok_s(runner, prompts, ways[way], tokens, streams))
        swaps = runner.loras.swaps - swaps_before
        with torch.inference_mode():
            start = time.perf_counter()
            for _ in range(5):
                runner.loras.slots.fill(0, runner.loras.adapters[1])
            fill_ms = (time.perf_counter() - start) / 5 * 1000.0
    median = {w: statistics.median(r) for w, r in rates.items()}
    mixed_ratio = statistics.median(m / b for m, b in zip(rates["mixed"], rates["base"]))
    swap_ratio = statistics.median(s / b for s, b in zip(rates["swap"], rates["base"]))
    return {
        "model": str(directory.name),
        "streams": streams,
        "tokens": tokens,
        "adapters_resident": adapters,
        "rank": rank,
        "tok_s": {w: [round(x, 1) for x in r] for w, r in rates.items()},
        "tok_s_median": {w: round(x, 1) for w, x in median.items()},
        "mixed_over_base": round(mixed_ratio, 3),
        "swap_over_base": round(swap_ratio, 3),
        "swaps": swaps,
        "slot_fill_ms": round(fill_ms, 2),
        "slot_mb": round(runner.loras.slots.nbytes / adapters / 1e6, 1),
        "goal": GOAL,
        "ok": mixed_ratio >= GOAL,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ringserve bench lora", description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="what `ringserve serve --model` takes (default: the default model)")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument(
        "--adapters", type=int, default=4, help="resident adapters (the swap run spreads over twice as many)"
    )
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    import torch

    from ringserve.gpu_proc.cpu_ext import load_cpu_ops

    torch.set_num_threads(1)
    load_cpu_ops()
    r = measure(args.model, args.streams, args.tokens, args.adapters, args.rank, args.repeats)
    if args.json:
        print(json.dumps(r, indent=2))
    else:
        m = r["tok_s_median"]
        print(
            f"{r['model']}, {r['streams']} streams x {r['tokens']} tokens, rank {r['rank']}: base {m['base']} tok/s, "
            f"{r['adapters_resident']} adapters mixed {m['mixed']} ({r['mixed_over_base']}x, goal {GOAL}), "
            f"{2 * r['adapters_resident']} adapters over {r['adapters_resident']} slots {m['swap']} "
            f"({r['swap_over_base']}x, {r['swaps']} swaps, {r['slot_fill_ms']} ms a fill of {r['slot_mb']} MB); "
            f"{'ok' if r['ok'] else 'FAILED'}"
        )
    return 0 if r["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
