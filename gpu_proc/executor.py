"""Everything the GPU process computes with: the model on its device, the KV pool, the runner and
the sampler, built from the one Config. The scheduler (pure Python) sits beside it in the loop."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ringserve.config import DEFAULTS, Config
from ringserve.gpu_proc.cpu_tuning import tune_cpu_process
from ringserve.gpu_proc.grammar import GrammarMasks, GrammarState
from ringserve.gpu_proc.grammar_compile import GPU_TIMEOUT_FACTOR
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.kv_sizing import GIB, device_memory, kv_block_bytes, memory_plan_lines, plan_for_model
from ringserve.gpu_proc.logits_processors import ControlsState, row_settings
from ringserve.gpu_proc.lora import AdapterError, LoraRegistry
from ringserve.gpu_proc.model.loader import load_model, read_special_tokens
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.pooling import sums as pooled_sums
from ringserve.gpu_proc.prompt_logprobs import score
from ringserve.gpu_proc.sampler import SampleOutput, sample
from ringserve.gpu_proc.step import SeqStep, StepBatch
from ringserve.gpu_proc.warmup import WarmupReport, warm_up

log = logging.getLogger("ringserve.gpu")


def resolve_device(requested: str) -> torch.device:
    if requested == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but torch sees no CUDA device")
    if requested == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(requested)


@dataclass
class Executor:
    """Runs one step on the device: the forward, the logits controls and grammar masks, the
    sampler (`step`), and frees what finished sequences held (`release`). The loop around it and
    the scheduler beside it are `main.EngineLoop` and `scheduler.Scheduler`."""

    runner: ModelRunner
    eos_token_ids: frozenset[int]
    vocab_size: int
    num_blocks: int
    device: torch.device
    dtype: torch.dtype
    warmup: WarmupReport | None = None
    attention: dict = field(default_factory=dict)  # the backend per op and its start-up check (facts)
    tokenizer_file: str | None = None  # the model's tokenizer.json: structured output's matchers read it
    # --grammar-timeout-s (a compile here gets GPU_TIMEOUT_FACTOR times it)
    grammar_timeout_s: float = DEFAULTS.grammar_timeout_s
    controls: ControlsState = field(init=False)  # the logits controls' per-sequence state
    grammar: GrammarState = field(init=False)  # structured output's per-sequence matchers

    def __post_init__(self) -> None:
        self.controls = ControlsState(self.vocab_size, self.eos_token_ids, self.device)
        self.grammar = GrammarState(
            self.tokenizer_file,
            self.vocab_size,
            self.eos_token_ids,
            self.device,
            compile_timeout_s=self.grammar_timeout_s * GPU_TIMEOUT_FACTOR,
        )

    def weights(self) -> dict:
        """How the weights are served (the GPU process publishes it for /health and the model card):
        `Llama.weights_served` and their bytes."""
        model = self.runner.model
        served = getattr(model, "weights_served", lambda: {"quantization": "none"})()
        return {**served, "bytes": weights_bytes(model)}

    def step(self, batch: StepBatch) -> SampleOutput | None:
        """One forward pass and the samples of its sampling rows, with the prompt logprobs of its
        scoring rows and the hidden-state sums of its pooling rows (None when no row samples,
        scores or pools)."""
        self.release(batch.finished)
        rows = batch.sampling_rows  # a draft row samples at each position it verifies
        masks = self.grammar.begin(rows) if rows else None  # filled while the forward runs
        hidden = None
        if batch.pools:
            logits, hidden = self.runner.execute_pooling(batch)
        else:
            logits = self.runner.execute(batch)
        out = sample_rows(self.controls, logits[: len(rows)], rows, masks) if rows else None
        if masks is not None and masks.paused and out is not None:
            out.paused = frozenset(masks.paused)  # NOTE: final once the masks were applied
        if batch.scores_prompts:
            out = out or SampleOutput([], [], [])
            out.prompt_logprobs = score(logits[len(rows) :], batch)
        if hidden is not None:
            out = out or SampleOutput([], [], [])
            out.pooled = pooled_sums(hidden, batch)
        return out

    def release(self, seq_ids: list[int]) -> None:
        """Free the per-sequence state of sequences that ended (the batch names them)."""
        if seq_ids:
            self.controls.forget(seq_ids)
            self.grammar.forget(seq_ids)


def sample_rows(
    controls: ControlsState, logits: torch.Tensor, rows: list[SeqStep], grammar: GrammarMasks | None = None
) -> SampleOutput:
    """Sample a step's sampling rows (`logits` `[R, vocab]`): the logits controls' plan first, when a
    row has controls or a grammar mask (`logits` modified in place for those rows), then the
    sampler; a processed row's logprobs are recomputed from its raw logits, as vLLM reports them."""
    sampling = row_settings(rows)
    positions = [s.context_len for s in rows]
    if grammar is None and all(r.controls is None for r in sampling):
        return sample(logits, sampling, positions)  # the common case: nothing more at all
    with torch.inference_mode():  # the runner's logits are inference tensors
        plan = controls.plan(rows, grammar)
        if plan is None:  # not reached: a row has controls
            return sample(logits, sampling, positions)
        raw = plan.apply(logits)
        out = sample(logits, sampling, positions)
        plan.report_raw(raw, out, sampling)
    return out


def _load_cpu_kernels(progress: Callable[[], None] | None) -> bool:
    """Build (first start on this machine) and load the CPU kernels now, before READY, so no step
    ever waits for a compiler; False, with the reason logged, where they cannot be built."""
    from ringserve.gpu_proc.cpu_ext import CpuOpsUnavailable, load_cpu_ops

    t0 = time.monotonic()
    try:
        load_cpu_ops(progress)
    except CpuOpsUnavailable as exc:
        log.warning("CPU kernels unavailable, serving with the torch reference path (slower): %s", exc)
        return False
    log.info("CPU kernels ready in %.1f s", time.monotonic() - t0)
    return True


def weights_bytes(model) -> int:
    """Bytes the model's weights take (tied weights and fused views counted once; a weight served
    from its GGUF blocks by the blocks' bytes, its float parameter never being allocated)."""
    storages = {
        p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters() if not p.is_meta
    }
    return sum(storages.values()) + getattr(model, "quantized_bytes", 0)


def served_formats(model) -> dict[str, int]:
    """The GGUF formats the model holds as blocks, with their tensor counts (empty: none)."""
    return model.weights_served()["formats"] if hasattr(model, "weights_served") else {}


def _weights_kind(model, dtype_name: str) -> str:
    """The memory plan's word for the weights: their dtype, and the GGUF formats held as blocks."""
    formats = served_formats(model)
    return dtype_name + "".join(f" + {n} {f}" for f, n in sorted(formats.items()))


def kv_cache_dtype(
    config: Config, model_dtype: torch.dtype, device: torch.device, quantized: bool = False
) -> torch.dtype:
    """The KV pool's dtype. `--kv-cache-dtype bfloat16` under a float32 model on the CPU, where the
    kernels and the reference read it (the CUDA kernels take the model's only); float32 asks for
    the model's float32 explicitly. auto: the model's, except bfloat16 under a float32 model whose
    weights the CPU kernels serve as GGUF blocks (`quantized`) on a CPU with bfloat16 dot products:
    there a decode step's float32 attention was a third of its time, and the bfloat16 cache served
    1.15-1.3x the tokens at 1 to 32 streams with the held text's loglikelihood within 0.2 % of the
    reference (docs/BENCHMARKS.md, "A bfloat16 KV cache under quantized weights")."""
    from ringserve.gpu_proc import cpu_ext

    choice = config.kv_cache_dtype
    if choice == "auto":
        on_blocks = quantized and device.type == "cpu" and model_dtype == torch.float32
        return torch.bfloat16 if on_blocks and cpu_ext.cpu_bf16_dot() else model_dtype
    if choice == "float32":
        if model_dtype != torch.float32:
            raise RuntimeError(
                f"--kv-cache-dtype float32 needs a float32 model (this one is {str(model_dtype).removeprefix('torch.')})"
            )
        return model_dtype
    if model_dtype == torch.bfloat16:
        return model_dtype
    if device.type != "cpu" or model_dtype != torch.float32:
        raise RuntimeError(
            f"--kv-cache-dtype {choice} needs a float32 model on the CPU "
            f"(this one is {str(model_dtype).removeprefix('torch.')} on {device.type}); use --dtype bfloat16 instead"
        )
    return torch.bfloat16


def served_kv_dtype(config: Config, model, cpu_kernels: bool = True) -> torch.dtype:
    """The KV pool's dtype a server gives `model` (`kv_cache_dtype` over what it serves as blocks):
    what benches and tests that build their own pool use, so they measure what is served."""
    quantized = cpu_kernels and bool(served_formats(model))
    return kv_cache_dtype(config, model.dtype, model.device, quantized=quantized)


def _num_blocks(config: Config, model, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype) -> int:
    """The KV pool's size: --num-blocks, the CPU default, or what the GPU's memory leaves (the plan
    goes to the log)."""
    dtype_name = str(dtype).removeprefix("torch.")
    if config.num_blocks or device.type != "cuda":
        num_blocks = config.num_blocks or config.cpu_kv_blocks
        args = model.args
        block = kv_block_bytes(
            num_layers=args.num_layers,
            num_kv_heads=args.num_kv_heads,
            head_dim=args.head_dim,
            block_size=config.block_size,
            dtype_bytes=kv_dtype.itemsize,
        )
        log.info(
            "memory plan: weights %.2f GiB (%s); KV cache %d blocks x %.2f MiB = %.2f GiB (%s), %d tokens",
            weights_bytes(model) / GIB,
            _weights_kind(model, dtype_name),
            num_blocks,
            block / 2**20,
            num_blocks * block / GIB,
            str(kv_dtype).removeprefix("torch."),
            num_blocks * config.block_size,
        )
        return num_blocks
    args = model.args
    free, total = device_memory(device)
    plan = plan_for_model(
        total_bytes=total,
        free_bytes=free,
        utilization=config.gpu_memory_utilization,
        num_layers=args.num_layers,
        num_kv_heads=args.num_kv_heads,
        head_dim=args.head_dim,
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        vocab_size=args.vocab_size,
        dtype_bytes=dtype.itemsize,
        block_size=config.block_size,
        max_rows=config.max_rows,
        prefill_budget=config.prefill_budget,
    )
    for line in memory_plan_lines(plan, weights_bytes(model), dtype_name):  # CUDA: never blocks, yet
        log.info("%s", line)
    return plan.num_blocks


def choose_attention(config: Config, model, device: torch.device, kernels=None, progress=None) -> dict:
    """Pick the attention backend `--attention-backend` asks for and, for the CuPy kernels (or
    `kernels`, launchers on another executor: the CPU harness in tests), verify every op on the
    device against the torch reference before serving with it (`attention/self_check.py`). Sets the
    model's backend; returns what the GPU process publishes about it."""
    from ringserve.gpu_proc.attention import kernels_backend, reference_backend
    from ringserve.gpu_proc.attention.self_check import ERROR_CHARS, OPS, KernelCheckFatal, verify

    def unchecked(backend) -> dict:
        model.setup(device, backend)
        return {"backend": backend.name, "ops": dict.fromkeys(OPS, backend.name), "checked": False, "failures": []}

    want = config.attention_backend
    if want == "reference":
        return unchecked(reference_backend())
    if kernels is None:
        if device.type != "cuda":
            if want == "cupy":
                raise RuntimeError("--attention-backend cupy needs a CUDA device (this one is the CPU)")
            return unchecked(model.backend)  # the compiled CPU kernels or the reference, as loaded
        try:
            import cupy  # noqa: F401

            from ringserve.gpu_proc.attention import cupy_backend
        except ImportError as exc:
            if want == "cupy" or config.require_kernels:
                raise RuntimeError(f"the CuPy attention kernels need CuPy, which does not import ({exc})") from None
            log.warning("CuPy does not import (%s): serving attention with the torch reference (slower)", exc)
            return unchecked(reference_backend())
        kernels = cupy_backend.default_kernels()
    from ringserve.gpu_proc.attention.cupy_backend import op_kernels

    args = model.args
    shape = (model.dtype, args.head_dim, args.num_heads, args.num_kv_heads)
    backend = kernels_backend(kernels)
    # NOTE: compiled here (the warm-up then finds them compiled), so a check never times a compile.
    try:
        kernels.compile(*shape, device, progress)
    except Exception as exc:  # NVRTC refused the source: nothing to check, the reference serves
        if config.require_kernels:
            raise KernelCheckFatal(f"--require-kernels: the attention kernels do not compile: {exc}") from exc
        log.error("attention kernels do not compile, serving with the torch reference: %s", exc)
        error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
        return {**unchecked(reference_backend()), "failures": [{"op": "compile", "error": error}]}
    names = op_kernels(*shape, kernels.executor.capability(device))
    served, report = verify(backend, kernels, *shape, device, names, progress)
    if report.failed and config.require_kernels:
        worst = report.failed[0]
        raise KernelCheckFatal(
            f"--require-kernels: the {worst.op} kernel check failed ({', '.join(worst.kernels)}: worst error "
            f"{worst.worst_error:.3g} on {worst.shape}{'; ' + worst.error if worst.error else ''})"
        )
    model.setup(device, served)
    facts = {"backend": served.name, "checked": True, **report.facts()}
    if model.device_blocks:  # GGUF blocks read by the CUDA kernels: checked the same way
        from ringserve.gpu_proc.quant_cuda import verify_model

        facts["quantized"] = verify_model(model, device, config.require_kernels, progress)
    return facts


def _lora_kernels(dtype, device):
    """The CUDA LoRA kernels once they pass the start-up check (`lora_cuda.check_lora_kernels`),
    else None: the deltas then run as the reference's torch ops, and the log says why."""
    try:
        from ringserve.gpu_proc.lora_cuda import check_lora_kernels, default_kernels

        kernels = default_kernels()
        kernels.compile(dtype, device)
        problem = check_lora_kernels(kernels, dtype, device)
    except Exception as exc:  # noqa: BLE001 - no CuPy, a compile failure: the reference serves
        problem = f"{type(exc).__name__}: {exc}"
    if problem is not None:
        log.warning("LoRA kernels failed their start-up check (%s); the reference serves the deltas", problem)
        return None
    return kernels


def load_loras(config: Config, model, progress: Callable[[], None]) -> LoraRegistry | None:
    """The `--lora-modules` adapters, loaded and checked against the model (None: none asked for,
    nor any at runtime: `--lora-dir`).
    A bad adapter fails the start, naming it: a missing adapter must not turn into 404s later."""
    if not config.loras and not config.lora_dir:
        return None
    registry = LoraRegistry(model.args, config.max_loras, config.max_lora_rank, model.device, model.dtype)
    for name, path in config.loras.items():
        try:
            registry.load(name, path)
        except AdapterError as exc:
            raise AdapterError(f"--lora-modules {name}={path}: {exc}") from None
        progress()
    if model.device.type == "cuda":
        registry.kernels = _lora_kernels(model.dtype, model.device)
    log.info(
        "LoRA adapters: %s (%d resident slots of rank %d, %.1f MB)",
        ", ".join(registry.ids),
        config.max_loras,
        config.max_lora_rank,
        registry.slots.nbytes / 1e6,
    )
    return registry


def build_executor(
    config: Config, model_dir: str | Path, progress: Callable[[], None] | None = None, kernels=None
) -> Executor:
    """Load the model, size and allocate the KV pool, build or compile the kernels and run the
    warm-up steps. `progress()`, if given, is called as loading advances (per tensor read, per
    phase, while the CPU kernels build the first time, between kernel compiles), never more than a
    few seconds apart: the GPU process beats its heartbeat from it, so a load that stops making
    progress is caught by the watchdog. `kernels`: the attention launchers to verify and serve with
    instead of CuPy's (tests run them on the CPU harness)."""
    progress = progress or (lambda: None)
    device = resolve_device(config.device)
    progress()
    cpu_kernels = False
    if device.type == "cpu":
        # API workers share these cores: torch's default of one thread per core starves them.
        tune_cpu_process(config.cpu_threads, pin=config.cpu_pin)
        cpu_kernels = config.cpu_kernels and _load_cpu_kernels(progress)
    model = load_model(
        model_dir,
        device,
        config.dtype,
        config.load_format,
        progress=progress,
        cpu_kernels=cpu_kernels,
        quantization=config.quantization,
    )
    dtype = model.dtype
    attention = choose_attention(config, model, device, kernels, progress)
    special = read_special_tokens(model_dir)
    args = model.args
    kv_dtype = served_kv_dtype(config, model, cpu_kernels)
    num_blocks = _num_blocks(config, model, device, dtype, kv_dtype)
    progress()
    pool = KVPool(args.num_layers, num_blocks, args.num_kv_heads, args.head_dim, config.block_size, kv_dtype, device)
    progress()
    runner = ModelRunner(model, pool, load_loras(config, model, progress))
    report = warm_up(runner, progress)
    served_by = model.backend.name if model.backend is not None else "none"
    # NOTE: the reference attention reads the step's lengths back to the host: not capturable.
    if device.type == "cuda" and config.cuda_graphs and served_by == "cupy":
        from ringserve.gpu_proc.cuda_graphs import DecodeGraphs

        limit = min(config.context_limit, args.max_position_embeddings)
        runner.graphs = DecodeGraphs(runner, config.max_rows, limit)
        runner.graphs.capture_all(progress)
    elif device.type == "cuda" and config.cuda_graphs:
        log.warning("CUDA graphs off: attention is served by %s, not the CuPy kernels alone", served_by)
    tokenizer = Path(model_dir) / "tokenizer.json"
    return Executor(
        runner,
        special.eos_token_ids,
        args.vocab_size,
        num_blocks,
        device,
        dtype,
        report,
        attention,
        tokenizer_file=str(tokenizer) if tokenizer.is_file() else None,
        grammar_timeout_s=config.grammar_timeout_s,
    )
