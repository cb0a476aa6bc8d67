"""`make kernel-check`: every planted bug (planted.py) is caught by the harness. Each is applied
alone, its source built, and a detector suite (decode, split decode, strided q, GQA 4 and 8, prefill
and mixed steps on both prefill kernels, KV append, in forward, reverse and random order) run until something fails; the
test records which check caught it. Without RINGSERVE_KERNEL_CHECK=full only the catalogue's
snippets are checked against the current source (cheap), not the bugs themselves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from .cases import assert_close, decode_specs, make_case, oracle, strided_q
from .conftest import FULL
from .executor import HarnessExecutor, KernelFault, load
from .planted import LAUNCHER_MODULES, LAUNCHERS, PLANTED, kernel_files, launcher_module

ORDERS = ("forward", "reverse", "random")


@dataclass(frozen=True)
class Launchers:
    """The three launcher classes on one executor, each from its real module or a planted copy."""

    attention: Any  # cupy_backend.AttentionKernels
    lora: Any  # lora_cuda.LoraKernels
    quant: Any  # quant_cuda.QuantKernels


def _detectors():
    """(what, run(kernels)) pairs; each raises when the kernels are wrong."""

    def decode(batch, ctx, heads, kvh, d, dtype, splits, strided=False):
        q, kc, vc, meta, dense = make_case(decode_specs(batch, ctx, ctx), heads, kvh, d, dtype, seed=ctx)
        want = oracle(q, meta, dense, d**-0.5)

        def run(k):
            qi = strided_q(q, kvh) if strided else q
            assert_close(k.attention.paged_decode(qi, kc, vc, meta, d**-0.5, num_splits=splits), want, dtype, "decode")

        return run

    def attention(specs, heads, kvh, d, dtype):
        q, kc, vc, meta, dense = make_case(specs, heads, kvh, d, dtype, seed=len(specs))
        want = oracle(q, meta, dense, d**-0.5)

        def run(k):
            assert_close(k.attention.paged_attention(q, kc, vc, meta, d**-0.5), want, dtype, "mixed step")
            assert_close(k.attention.paged_prefill(q, kc, vc, meta, d**-0.5), want, dtype, "prefill")

        return run

    def write_kv(k):
        from ringserve.gpu_proc.attention import reference

        gen = torch.Generator().manual_seed(1)
        kc = torch.zeros(6, 2, 16, 32)
        vc = torch.zeros_like(kc)
        kk, vv = torch.randn(20, 2, 32, generator=gen), torch.randn(20, 2, 32, generator=gen)
        slots = torch.randperm(96, generator=gen)[:20]
        wk, wv = kc.clone(), vc.clone()
        reference.write_kv(kk, vv, wk, wv, slots)
        k.attention.write_kv(kk, vv, kc, vc, slots)
        assert torch.equal(kc, wk) and torch.equal(vc, wv), "write_kv differs from the reference"

    def quant(fmt, dtype, n, k, t):
        from ringserve.gpu_proc.quant import dequantize
        from ringserve.gpu_proc.quant_cuda import random_blocks

        gen = torch.Generator().manual_seed(n * t)
        blocks = random_blocks(fmt, n, k, gen)
        x = torch.randn(t, k, generator=gen).to(dtype)
        want = (x.double() @ dequantize(blocks).double().T)[:, :, None]
        rows = torch.tensor([n - 1, 0, 1])

        def run(kern):
            qk = kern.quant
            assert_close(qk.gemv(x, blocks)[:, :, None], want, dtype, f"{fmt} GEMV")
            got = qk.dequantize(blocks, dtype, rows=rows)
            assert torch.equal(got, dequantize(blocks).to(dtype)[rows]), f"{fmt} dequantization differs"

        return run

    def lora(segs, r, fan_in, t, dtype):
        from ringserve.gpu_proc.lora_cuda import reference_add_

        from .test_lora_kernels import assert_lora_close, make

        # x and y both rows of wider buffers (a fused projection's slice): the launchers must pass
        # their strides, and nothing past y's columns may change.
        x, y, a, bt, slot_of = make(segs, r, fan_in, t, 3, dtype, seed=t, strided=True)
        want = y.clone()
        reference_add_(x, want, a, bt, slot_of)
        out = y.shape[1]

        def run(kern):
            wide = torch.full((t, out + 5), 7.0, dtype=dtype)
            wide[:, :out] = y
            kern.lora.add_(x, wide[:, :out], a, bt, slot_of, segs)
            assert_lora_close(wide[:, :out], want, y, slot_of, dtype, "LoRA delta")
            assert bool((wide[:, out:] == 7.0).all()), "LoRA delta: a column past y's differs"

        return run

    return [
        ("LoRA q|k|v, 9 tokens, fan-in 40", lora((72, 24, 24), 3, 40, 9, torch.float32)),
        ("decode GQA 4, split 3", decode(3, 300, 8, 2, 64, torch.float16, 3)),
        ("decode GQA 8, planned splits", decode(2, 600, 8, 1, 32, torch.float32, None)),
        ("decode strided q", decode(3, 70, 4, 2, 32, torch.float32, 1, strided=True)),
        ("mixed step", attention([(40, 20), (45, 1), (3, 1), (0, 33)], 4, 1, 64, torch.float16)),
        ("prefill tile edges", attention([(0, 31), (15, 17), (16, 32)], 4, 2, 32, torch.float32)),
        ("prefill GQA 3, three KV tiles", attention([(100, 40), (0, 70)], 6, 2, 64, torch.bfloat16)),
        ("write_kv", write_kv),
        ("Q4_1 GEMV, 3 rows, 34 blocks", quant("Q4_1", torch.float32, 6, 1088, 3)),
        ("Q5_0 GEMV, 9 rows", quant("Q5_0", torch.float32, 5, 96, 9)),
    ]


def _caught_by(exc: BaseException) -> str:
    text = str(exc)
    for key, label in (
        ("invalid memory access", "guard page / memory fault"),
        ("__syncthreads", "barrier check"),
        ("deadlock", "deadlock check"),
        ("__shfl", "shuffle check"),
        ("argument", "argument check"),
        ("non-finite", "NaN reached the output"),
        ("exceeds atol", "mismatch vs float64"),
        ("differs", "mismatch vs reference"),
    ):
        if key in text:
            return label
    return type(exc).__name__


def hunt(bug) -> tuple[str, str] | None:
    """Run the detector suite against `bug`; (detector, check) of the first failure, or None."""
    module = load(kernel_files(bug))
    attention, lora, quant = (launcher_module(bug, file) for file in LAUNCHER_MODULES)
    # sm_90 runs fp16/bf16 prefill on the tensor-core kernel, sm_75 on the CUDA-core one.
    for capability in ((9, 0), (7, 5)):
        for order in ORDERS:
            executor = HarnessExecutor(module, order=order, seed=3, sm_count=4, ctas_per_sm=2, capability=capability)
            kernels = Launchers(
                attention.AttentionKernels(executor), lora.LoraKernels(executor), quant.QuantKernels(executor)
            )
            for what, run in _detectors():
                try:
                    run(kernels)
                except (KernelFault, AssertionError, ValueError, TypeError) as exc:
                    where = f"{order}, sm_{capability[0]}{capability[1]}"
                    return what, f"{_caught_by(exc)} ({where}): {str(exc).splitlines()[0][:160]}"
    return None


def test_every_planted_snippet_is_in_the_current_source():
    """Each planted bug's snippet occurs exactly once where it is planted."""
    for bug in PLANTED:
        kernel_files(bug)
        launcher_module(bug, bug.file if bug.file in LAUNCHER_MODULES else LAUNCHERS)


def test_the_detectors_pass_on_the_real_source():
    """Without a bug, the detector suite passes: a catch below is the bug's doing."""
    assert hunt(None) is None


@pytest.mark.skipif(not FULL, reason="planted bugs run under `make kernel-check` (RINGSERVE_KERNEL_CHECK=full)")
@pytest.mark.parametrize("bug", PLANTED, ids=[b.name for b in PLANTED])
def test_planted_bug_is_caught(bug, record_property):
    caught = hunt(bug)
    assert caught is not None, f"planted bug not caught: {bug.name}"
    record_property("caught", f"{caught[0]}: {caught[1]}")
    print(f"\nPLANTED {bug.name} -> {caught[0]}: {caught[1]}")
