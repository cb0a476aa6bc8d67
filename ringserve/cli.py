"""The `ringserve` command.

Each subcommand lives in its own module with a `main(argv) -> int` that owns its argument
parsing; this file only dispatches, importing the module lazily so `ringserve shm` never pays for
torch and a worker never imports model code.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("ringserve.serve_cli", "run the server: supervisor, GPU process and API workers"),
    "shm": ("ringserve.tools.commands.shm_inspect", "list ringserve shared-memory segments and ring state"),
    "fetch-model": ("ringserve.tools.commands.fetch_model", "download and convert a model (or convert a .gguf) once"),
    "make-tiny-model": ("ringserve.tools.commands.make_tiny_model", "build the small test Llama checkpoint"),
    "grafana-dashboard": (
        "ringserve.tools.commands.grafana_dashboard",
        "print the Grafana dashboard JSON (deploy/grafana/)",
    ),
    "make-dummy-model": (
        "ringserve.tools.commands.make_dummy_model",
        "a weightless Llama-3-8B / Llama-2-7B shape for --load-format dummy",
    ),
    "drill": ("ringserve.tools.harness.drill", "crash-and-restart drills against a running server"),
    "loadtest": ("ringserve.tools.harness.loadtest", "open-loop load test of a /v1/completions endpoint"),
    "fleet": (
        "ringserve.tools.fleet.replicas",
        "N replicas on this machine behind one Envoy (or its config: --print-config)",
    ),
    "soak": ("ringserve.tools.harness.soak", "serve under load, then check blocks, fds, shm and RSS for leaks"),
    "gpu-check": (
        "ringserve.tools.commands.gpu_check",
        "the GPU suite, kernel and step benchmarks, load test and HF baseline",
    ),
    "kernel-resources": (
        "ringserve.tools.commands.kernel_resources",
        "registers, spills, occupancy, HMMA of each kernel (nvcc)",
    ),
}

# `ringserve bench NAME` -> module
BENCHES: dict[str, tuple[str, str]] = {
    "ring": ("ringserve.tools.bench.ring", "our ring vs pyzmq ipc vs multiprocessing.Queue"),
    "step": ("ringserve.tools.bench.step", "per-step host overhead and sampler time"),
    "sched-overhead": ("ringserve.tools.bench.sched_overhead", "scheduler pass time without a model"),
    "api": ("ringserve.tools.bench.api", "tokens/s one API worker streams"),
    "kernels": ("ringserve.tools.bench.kernels", "CUDA attention kernels against the bandwidth bound"),
    "sched": ("ringserve.tools.bench.sched_compare", "static / dynamic / continuous / chunked schedulers"),
    "hf": ("ringserve.tools.bench.hf_baseline", "the same trace through transformers generate (static batches)"),
    "prefix": ("ringserve.tools.bench.prefix", "TTFT and throughput with and without prefix caching"),
    "peers": ("ringserve.tools.bench.peers", "ringserve beside vLLM CPU: same checkpoint, client and run"),
    "fleet": ("ringserve.tools.bench.fleet", "Envoy's least-request vs ORCA-weighted round robin on one trace"),
    "structured": (
        "ringserve.tools.bench.structured",
        "decode steps with 0 / 1 / all rows grammar-constrained; the mask fill per row per token",
    ),
    "fairness": (
        "ringserve.tools.bench.fairness",
        "key A floods, key B sends one short request a second: B's admissions, TTFT and queue wait",
    ),
    "controls": (
        "ringserve.tools.bench.controls",
        "the sampler with and without vLLM's logits controls; prompt scoring",
    ),
    "cost-model": (
        "ringserve.tools.bench.cost_model",
        "the step cost model's estimates against measured decode, prefill and mixed steps",
    ),
    "quant": (
        "ringserve.tools.bench.quant",
        "GGUF files from their blocks vs dequantized: memory, loglikelihood, logits, greedy agreement",
    ),
    "lora": (
        "ringserve.tools.bench.lora",
        "decode tok/s with LoRA adapters mixed in the rows vs the base model alone; the swap cost",
    ),
    "tracing": (
        "ringserve.tools.bench.tracing",
        "tracing off, collector up, down and slow: tok/s, TTFT and the worker's memory",
    ),
    "overload": (
        "ringserve.tools.bench.overload",
        "closed-loop clients far past capacity: 429s, admitted TTFT, goodput at 32 and 512 streams",
    ),
}


def _usage() -> str:
    lines = ["usage: ringserve COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name:<18}{help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  bench {name:<12}{help_}" for name, (_, help_) in BENCHES.items()]
    lines += ["", "`ringserve COMMAND --help` shows a command's options."]
    return "\n".join(lines)


def _run(module_name: str, argv: list[str]) -> int:
    module = importlib.import_module(module_name)
    return int(module.main(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    command, rest = argv[0], argv[1:]
    if command == "bench":
        if not rest or rest[0] not in BENCHES:
            known = ", ".join(BENCHES)
            print(f"ringserve bench: name one of: {known}", file=sys.stderr)
            return 2
        return _run(BENCHES[rest[0]][0], rest[1:])
    if command not in COMMANDS:
        print(f"ringserve: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    return _run(COMMANDS[command][0], rest)


if __name__ == "__main__":
    sys.exit(main())
