"""The LoRA kernels (lora_sgmv.cu), run by their launchers (gpu_proc/lora_cuda.py) on the CPU
harness, against the float64 spec (`lora_cuda.reference_add_`, which is `LoraStep.delta`).

fp16, bf16 and fp32; one target and three side by side (q|k|v, block-diagonal B), ranks that are
not a multiple of the shrink CTA's 4 warps, fan-ins shorter and longer than a warp, outputs
across the expand CTA's 128 columns; tokens of the base model (slot -1) are untouched bit for
bit; a token's result is the same bits whatever else shares the launch; x strided; and the
start-up check passes here and fails on a planted kernel bug.
"""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu_proc.lora_cuda import LoraKernels, check_lora_kernels, reference_add_
from tests.gpu_proc.test_lora import _run, _runner, adapters, expected  # noqa: F401 (fixtures)
from tests.helpers.lora_adapters import ADAPTERS

from .conftest import pick
from .executor import HarnessExecutor, load
from .planted import PLANTED, kernel_files

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOL = {torch.float16: 3e-3, torch.bfloat16: 2e-2, torch.float32: 2e-5}  # x max(1, |y|)
ORDERS = ("forward", "reverse", "random")


def make(segs, r, fan_in, t, slots, dtype, seed, strided=False):
    gen = torch.Generator().manual_seed(seed)
    rank, out = r * len(segs), sum(segs)
    x = torch.randn(t, fan_in + 8 * strided, generator=gen)[:, :fan_in].to(dtype)
    y = torch.randn(t, out, generator=gen).to(dtype)
    a = (torch.randn(slots, rank, fan_in, generator=gen) / fan_in**0.5).to(dtype)
    bt = torch.zeros(slots, rank, out)
    col = 0
    for g, n in enumerate(segs):
        bt[:, g * r : (g + 1) * r, col : col + n] = torch.randn(slots, r, n, generator=gen) / r**0.5
        col += n
    slot_of = torch.randint(0, slots, (t,), generator=gen, dtype=torch.int32)
    slot_of[1::3] = -1  # tokens of the base model among them (none when t is 1)
    return x, y, a, bt.to(dtype), slot_of


def assert_lora_close(got, want, y, slot_of, dtype, what):
    base = slot_of < 0
    assert torch.equal(got[base], y[base]), f"{what}: a base-model token's row changed"
    err = (got.double() - want.double()).abs()
    bound = TOL[dtype] * torch.clamp(want.double().abs(), min=1.0)
    assert bool((err <= bound).all()), f"{what}: max |err| {float(err.max()):.3g} exceeds the {dtype} tolerance"


CASES = pick(
    [
        # targets' widths, rank per target, fan-in, tokens, slots, dtype, x strided
        ((576,), 16, 576, 5, 4, torch.float32, False),
        ((72, 24, 24), 3, 40, 9, 3, torch.float16, True),  # q|k|v, 9 ranks: a shrink CTA 1 warp short
        ((200, 200), 5, 96, 3, 2, torch.bfloat16, False),  # gate|up across two expand CTAs
        ((17,), 1, 8, 2, 1, torch.float32, True),  # fan-in under a warp, one rank
    ],
    [((130, 2, 9), r, k, t, 3, d, t % 2 == 0) for d in DTYPES for r in (1, 4, 7) for k, t in ((33, 1), (300, 6))],
)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_lora_add_matches_float64(case):
    segs, r, fan_in, t, slots, dtype, strided = CASES[case]
    x, y, a, bt, slot_of = make(segs, r, fan_in, t, slots, dtype, case, strided)
    want = y.clone()
    reference_add_(x, want, a, bt, slot_of)
    got = y.clone()
    LoraKernels(HarnessExecutor(order=ORDERS[case % 3], seed=case)).add_(x, got, a, bt, slot_of, segs)
    assert_lora_close(got, want, y, slot_of, dtype, f"{segs} r={r} in={fan_in} T={t} {dtype}")


def test_a_token_s_delta_does_not_depend_on_the_launch():
    """Row i of a 12-token launch equals the same token launched alone, bit for bit."""
    x, y, a, bt, slot_of = make((64, 16, 16), 4, 128, 12, 3, torch.float16, 5)
    k = LoraKernels(HarnessExecutor(order="random", seed=2))
    batch = y.clone()
    k.add_(x, batch, a, bt, slot_of, (64, 16, 16))
    for i in (0, 5, 11):
        alone = y[i : i + 1].clone()
        k.add_(x[i : i + 1].clone(), alone, a, bt, slot_of[i : i + 1].clone(), (64, 16, 16))
        assert torch.equal(alone, batch[i : i + 1]), f"token {i} differs alone"


def test_launcher_rejects_what_the_kernels_cannot_run():
    x, y, a, bt, slot_of = make((32,), 4, 16, 3, 2, torch.float32, 1)
    k = LoraKernels(HarnessExecutor())
    with pytest.raises(ValueError, match="segments"):
        k.add_(x, y, a, bt, slot_of, (16, 8))
    with pytest.raises(ValueError, match="int32"):
        k.add_(x, y, a, bt, slot_of.long(), (32,))
    with pytest.raises(ValueError, match="do not fit"):
        k.add_(x, y, a, bt[:, :, :16].contiguous(), slot_of, (32,))
    with pytest.raises(TypeError, match="share"):
        k.add_(x.half(), y, a, bt, slot_of, (32,))


def test_the_start_up_check_passes_and_catches_a_planted_bug():
    for dtype in DTYPES:
        assert check_lora_kernels(LoraKernels(HarnessExecutor()), dtype, torch.device("cpu")) is None
    bug = next(b for b in PLANTED if b.name.startswith("lora expand: target"))
    broken = LoraKernels(HarnessExecutor(load(kernel_files(bug))))
    assert check_lora_kernels(broken, torch.float32, torch.device("cpu")) is not None


def test_the_model_through_the_lora_kernels_is_peft(tiny_model_dir, adapters, expected):  # noqa: F811
    """The module forward (the CUDA path's) with the deltas through these kernels on the harness:
    four adapters and the base model mixed in one run give transformers + PEFT's greedy tokens."""
    prompts, want = expected
    runner = _runner(tiny_model_dir, adapters, cpu_kernels=False)
    runner.loras.kernels = kernels = LoraKernels(HarnessExecutor(order="random", seed=4))
    jobs = [(name, p) for p in prompts for name in [None, *ADAPTERS]]
    got = _run(runner, tiny_model_dir, jobs, max_rows=len(jobs), prefill_budget=64)
    assert got == [want[name][prompts.index(p)] for name, p in jobs]
    assert {n for n in kernels.executor.launches} == {"rs_lora_shrink<RsF32>", "rs_lora_expand<RsF32>"}
