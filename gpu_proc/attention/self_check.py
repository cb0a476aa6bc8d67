"""The kernels checked on the device before the server serves with them, and the reference where not.

The CPU execution harness runs the kernels' exact source, but it cannot see a real GPU's memory
model, barrier races, `mma.sync` rounding or a driver bug. So before READY the engine runs every
kernel instantiation the model will launch on small random inputs — shuffled block tables, ragged
lengths, the model's own GQA group and head size — and compares each result with the torch
reference (`reference.py`, the spec) on the same device:

    op        what runs                                          compared
    write_kv  KV append, a padding slot among the tokens          bit for bit
    decode    decode rows of ragged contexts, unsplit and split   atol + rtol * |ref|, twice the
              into KV chunks (the merge kernel)                    tests' tolerance (TOLERANCES):
    prefill   the prefill kernel the model uses (tensor-core or    the reference rounds P to the
              CUDA-core) over chunks and one-token rows            cache dtype before P.V
    mixed     the dispatch of a mixed step: decode kernel for its
              one-token rows, prefill kernel for its chunks

An op whose check fails — a mismatch, a non-finite value or an exception from the launch — is served
by the torch reference instead (`checked_backend`; a mixed step whose dispatch failed runs the
prefill kernel alone if that passed: it is exact for one-token rows too), and the failure is logged
with the kernel, its
worst error and the inputs' shape and published (model facts -> `/health` and
`ringserve_attention_backend_info`). A CUDA error that leaves the device unusable cannot be served
around: the check raises, and the process exits (the operator can start with `--attention-backend
reference`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import torch

from ..step import SeqStep, StepBatch
from ..step_inputs import build_step_inputs
from . import AttentionBackend, reference

log = logging.getLogger("ringserve.gpu")

# atol, rtol per dtype against the float64 oracle (the kernel tests' tolerances, tests/kernel_harness)
TOLERANCES = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2), torch.float32: (2e-5, 1e-4)}
OPS = ("write_kv", "decode", "prefill", "mixed")
BLOCK = 16
# (cached, new) tokens per sequence: ragged decode rows across block edges, chunks beside them.
DECODE_SPECS = ((0, 1), (15, 1), (16, 1), (47, 1), (130, 1), (299, 1))
MIXED_SPECS = ((0, 33), (20, 17), (47, 1), (5, 1), (64, 40))
DECODE_SPLITS = 3  # forced, so the merge kernel runs whatever the planner would choose
ERROR_CHARS = 120  # of an exception's text kept in the report (the model facts hold 2 KB in all)


class KernelCheckFatal(RuntimeError):
    """A kernel failed in a way the reference cannot serve around (the CUDA context is broken)."""


@dataclass(frozen=True)
class OpCheck:
    """One op's verdict: which kernels ran, on what shape, and how far from the reference."""

    op: str
    kernels: tuple[str, ...]
    shape: str
    ok: bool
    worst_error: float  # max |kernel - reference| (inf: non-finite; nan: the launch raised)
    tolerance: str
    error: str | None = None


@dataclass(frozen=True)
class CheckReport:
    checks: tuple[OpCheck, ...]
    seconds: float
    ops: dict[str, str] = field(default_factory=dict)  # op -> backend that serves it

    @property
    def failed(self) -> list[OpCheck]:
        return [c for c in self.checks if not c.ok]

    def facts(self) -> dict:
        """What the GPU process publishes (model facts: /health, /metrics)."""
        return {
            "ops": dict(self.ops),
            "check_s": round(self.seconds, 3),
            "failures": [
                {k: v for k, v in asdict(c).items() if k != "ok"} | {"worst_error": _json_float(c.worst_error)}
                for c in self.failed
            ],
        }


def _json_float(x: float) -> float | str:
    return x if x == x and abs(x) != float("inf") else str(x)


def _case(specs, num_heads: int, num_kv_heads: int, head_dim: int, dtype, device, seed: int):
    """q, caches and metadata for sequences of (cached, new) tokens over shuffled blocks; every
    slot a sequence may read is written (the rest stay zero)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    rng = random.Random(seed)
    need = sum(-(-(c + n) // BLOCK) for c, n in specs) + 1
    ids = list(range(need))
    rng.shuffle(ids)
    steps, slots = [], []
    for i, (cached, new) in enumerate(specs):
        table = [ids.pop() for _ in range(-(-(cached + new) // BLOCK))]
        steps.append(SeqStep(i, [0] * new, cached, table))
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(cached + new)]
    shape = (need, num_kv_heads, BLOCK, head_dim)
    k_cache = torch.zeros(shape, dtype=dtype, device=device)
    v_cache = torch.zeros(shape, dtype=dtype, device=device)
    kv = torch.randn(2, len(slots), num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    reference.write_kv(kv[0], kv[1], k_cache, v_cache, torch.tensor(slots, device=device))
    meta = build_step_inputs(StepBatch(steps), BLOCK, device).meta
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen).to(dtype).to(device)
    return q, k_cache, v_cache, meta


def _worst(got: torch.Tensor, want: torch.Tensor, dtype) -> tuple[bool, float, str]:
    atol, rtol = (2 * x for x in TOLERANCES[dtype])
    if not torch.isfinite(got).all():
        return False, float("inf"), f"{atol:g} + {rtol:g}*|ref|"
    err = (got.double() - want.double()).abs()
    ok = bool((err <= atol + rtol * want.double().abs()).all())
    return ok, float(err.max()) if err.numel() else 0.0, f"{atol:g} + {rtol:g}*|ref|"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_kernels(
    kernels,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
    names: dict[str, tuple[str, ...]],
    progress: Callable[[], None] | None = None,
) -> tuple[OpCheck, ...]:
    """Run each op on `kernels` (`cupy_backend.AttentionKernels`) and the reference; `names` maps an
    op to the kernel instantiations it launches (for the report)."""
    beat = progress or (lambda: None)
    scale = head_dim**-0.5
    shapes = f"heads {num_heads}/{num_kv_heads}, head_dim {head_dim}, {str(dtype).removeprefix('torch.')}"

    def write_kv():
        gen = torch.Generator(device="cpu").manual_seed(1)
        cache = (9, num_kv_heads, BLOCK, head_dim)
        kc, vc = torch.zeros(cache, dtype=dtype, device=device), torch.zeros(cache, dtype=dtype, device=device)
        t = 37
        kv = torch.randn(2, t, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
        slots = torch.randperm(9 * BLOCK, generator=gen)[:t]
        slots[5] = -1  # padding: writes nothing
        slots = slots.to(device)
        wk, wv = kc.clone(), vc.clone()
        reference.write_kv(kv[0], kv[1], wk, wv, slots)
        kernels.write_kv(kv[0], kv[1], kc, vc, slots)
        _sync(device)
        exact = torch.equal(kc, wk) and torch.equal(vc, wv)
        diff = max(float((kc.double() - wk.double()).abs().max()), float((vc.double() - wv.double()).abs().max()))
        return exact, diff, "bit for bit", f"{t} tokens into 9 blocks, {shapes}"

    def decode():
        q, kc, vc, meta = _case(DECODE_SPECS, num_heads, num_kv_heads, head_dim, dtype, device, seed=2)
        want = reference.paged_attention(q, kc, vc, meta, scale)
        verdicts = [
            _worst(kernels.paged_decode(q, kc, vc, meta, scale, num_splits=n), want, dtype) for n in (1, DECODE_SPLITS)
        ]
        _sync(device)
        ok = all(v[0] for v in verdicts)
        return ok, max(v[1] for v in verdicts), verdicts[0][2], f"{len(DECODE_SPECS)} rows, ctx 1-300, {shapes}"

    def chunks(run_kernel):
        q, kc, vc, meta = _case(MIXED_SPECS, num_heads, num_kv_heads, head_dim, dtype, device, seed=3)
        want = reference.paged_attention(q, kc, vc, meta, scale)
        ok, worst, tol = _worst(run_kernel(q, kc, vc, meta, scale), want, dtype)
        _sync(device)
        return ok, worst, tol, f"chunks {list(MIXED_SPECS)}, {shapes}"

    def prefill():
        return chunks(kernels.paged_prefill)

    def mixed():
        return chunks(kernels.paged_attention)

    checks = []
    for op, run in (("write_kv", write_kv), ("decode", decode), ("prefill", prefill), ("mixed", mixed)):
        try:
            ok, worst, tol, shape = run()
            checks.append(OpCheck(op, names.get(op, ()), shape, ok, worst, tol))
        except Exception as exc:  # a launch that raised (a CUDA error, a bad argument): fall back
            _usable_or_raise(device, op, exc)
            error = f"{type(exc).__name__}: {exc}"[:ERROR_CHARS]
            checks.append(OpCheck(op, names.get(op, ()), shapes, False, float("nan"), "-", error))
        beat()
    return tuple(checks)


def _usable_or_raise(device: torch.device, op: str, exc: Exception) -> None:
    """After a failed launch, the reference can take over only if the device still works."""
    if device.type != "cuda":
        return
    try:
        torch.zeros(1, device=device).add_(1).item()
    except Exception as again:
        raise KernelCheckFatal(
            f"the {op} kernel failed with a CUDA error that leaves the device unusable ({exc}); "
            f"start with --attention-backend reference to serve without the CuPy kernels"
        ) from again


def served_by(ok: dict[str, bool], kernels_name: str) -> dict[str, str]:
    """op -> the backend that serves it, from each op's verdict."""
    ops = {op: kernels_name if ok.get(op) else "reference" for op in OPS}
    if not ok.get("mixed") and ok.get("prefill"):
        ops["mixed"] = f"{kernels_name} prefill"
    return ops


def checked_backend(kernels_backend: AttentionBackend, kernels, checks: tuple[OpCheck, ...]) -> AttentionBackend:
    """The kernels for every op that passed, the reference for the others."""
    ok = {c.op: c.ok for c in checks}
    if all(ok.get(op, False) for op in OPS):
        return kernels_backend
    write_kv = kernels.write_kv if ok.get("write_kv") else reference.write_kv
    decode = kernels.paged_decode if ok.get("decode") else reference.paged_attention
    if ok.get("mixed"):
        mixed = kernels.paged_attention
    elif ok.get("prefill"):  # the prefill kernel is exact for one-token rows too: it takes the whole step
        mixed = kernels.paged_prefill
    else:
        mixed = reference.paged_attention

    def paged_attention(q, k_cache, v_cache, meta, scale):
        return (decode if meta.max_query_len == 1 else mixed)(q, k_cache, v_cache, meta, scale)

    return AttentionBackend(f"{kernels_backend.name}+reference", write_kv, paged_attention, kernels_backend.compile)


def verify(
    backend: AttentionBackend,
    kernels,
    dtype: torch.dtype,
    head_dim: int,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
    names: dict[str, tuple[str, ...]],
    progress: Callable[[], None] | None = None,
) -> tuple[AttentionBackend, CheckReport]:
    """Check the kernels and return the backend to serve with, and the report to publish."""
    t0 = time.perf_counter()
    checks = check_kernels(kernels, dtype, head_dim, num_heads, num_kv_heads, device, names, progress)
    served = checked_backend(backend, kernels, checks)
    ops = served_by({c.op: c.ok for c in checks}, backend.name)
    report = CheckReport(checks, time.perf_counter() - t0, ops)
    for c in report.failed:
        log.error(
            "attention kernel check FAILED for %s (%s): worst error %.3g (tolerance %s) on %s%s; "
            "serving %s with the torch reference",
            c.op,
            ", ".join(c.kernels),
            c.worst_error,
            c.tolerance,
            c.shape,
            f": {c.error}" if c.error else "",
            c.op,
        )
    if not report.failed:
        log.info("attention kernels verified against the reference in %.2f s: %s", report.seconds, backend.name)
    return served, report
