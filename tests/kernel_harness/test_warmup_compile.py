"""No compile inside a served step: the engine's load compiles every kernel the model launches,
with heartbeats between compiles, and runs the warm-up steps; the steps after it compile nothing.

The kernels run on the CPU harness with an injected slow compile (each kernel takes as long as an
NVRTC compile of this source on a slow host), and the harness refuses to launch a kernel that was
not compiled first.
"""

from __future__ import annotations

import time

import pytest
import torch

from ringserve.config import Config
from ringserve.gpu_proc.attention import kernels_backend
from ringserve.gpu_proc.attention.cupy_backend import AttentionKernels, model_kernels
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import OfflineRequest, generate
from ringserve.gpu_proc.warmup import warm_up
from ringserve.shm.messages import SamplingParams

from .executor import HarnessExecutor, KernelFault

DELAY_S = 0.3


class SlowCompile(HarnessExecutor):
    """The harness, each kernel's compile taking DELAY_S; launches of uncompiled kernels fail."""

    def __init__(self) -> None:
        super().__init__(require_compile=True)
        self.compile_calls = 0

    def compile(self, names, device, progress=None):
        for name in names:
            time.sleep(DELAY_S)
            self.compile_calls += 1
            super().compile([name], device, progress)


def _runner(model_dir, executor) -> ModelRunner:
    model = load_model(model_dir, "cpu", torch.float32)
    model.setup("cpu", kernels_backend(AttentionKernels(executor), "harness"))
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, 64, a.num_kv_heads, a.head_dim))


def _serve(runner) -> None:
    reqs = [
        OfflineRequest(
            prompt_ids=list(range(3, 3 + n)), max_tokens=4, sampling=SamplingParams(temperature=0.0, ignore_eos=True)
        )
        for n in (30, 1, 9)
    ]
    generate(runner, reqs, eos_token_ids=frozenset(), prefill_budget=16)


def test_warm_up_compiles_every_kernel_with_heartbeats_between(tiny_model_dir):
    """Each kernel compile is followed by a heartbeat; no gap exceeds one compile plus a step."""
    executor = SlowCompile()
    runner = _runner(tiny_model_dir, executor)
    beats = [time.monotonic()]
    report = warm_up(runner, progress=lambda: beats.append(time.monotonic()))
    args = runner.model.args
    assert set(report.compiled) == set(
        model_kernels(
            torch.float32, args.head_dim, args.num_heads, args.num_kv_heads, executor.capability(runner.device)
        )
    )
    assert executor.compile_calls == len(report.compiled) == 4
    gaps = [b - a for a, b in zip(beats, beats[1:])]
    assert len(gaps) >= executor.compile_calls + 3
    assert max(gaps) < DELAY_S + 1.0, f"longest stretch without a heartbeat: {max(gaps):.2f} s"
    assert report.compile_s >= 4 * DELAY_S
    assert runner.kv_pool.k_all.eq(0).all() and runner.kv_pool.v_all.eq(0).all()  # warm-up left no KV behind


def test_steps_after_the_warm_up_compile_nothing(tiny_model_dir):
    """Prefill, mixed and decode steps then run without one more compile."""
    executor = SlowCompile()
    runner = _runner(tiny_model_dir, executor)
    warm_up(runner)
    calls = executor.compile_calls
    _serve(runner)
    assert executor.compile_calls == calls
    assert {"rs_kv_append", "rs_paged_decode", "rs_paged_prefill"} <= {n.split("<")[0] for n in executor.launches}


def test_without_the_warm_up_the_first_step_would_compile(tiny_model_dir):
    """The check above can fail: a step that needs an uncompiled kernel is refused by the harness."""
    runner = _runner(tiny_model_dir, SlowCompile())
    with pytest.raises(KernelFault, match="launched without having been compiled"):
        _serve(runner)


def test_build_engine_warms_up_and_beats_during_load(tiny_model_dir):
    """The engine's load runs the warm-up steps and calls progress between its phases."""
    from ringserve.gpu_proc.executor import build_executor

    beats = []
    engine = build_executor(
        Config(device="cpu", dtype="float32", num_blocks=32),
        tiny_model_dir,
        progress=lambda: beats.append(time.monotonic()),
    )
    assert engine.warmup is not None and engine.warmup.steps_s > 0
    assert len(beats) >= 5
    assert engine.runner.kv_pool.k_all.eq(0).all()
