"""Building and loading the CPU kernels: the heartbeat during a build, clear failures, the fallback."""

from __future__ import annotations

import time

import pytest
import torch

from ringserve.gpu_proc import cpu_ext


def test_a_build_calls_progress_while_it_runs(monkeypatch):
    """A slow build runs in a thread; the caller's progress callback keeps being called."""
    built = []
    monkeypatch.setattr(cpu_ext, "ops_loaded", lambda: bool(built))
    monkeypatch.setattr(cpu_ext, "_build", lambda: (time.sleep(1.2), built.append(True)))
    calls = []
    cpu_ext.load_cpu_ops(progress=lambda: calls.append(time.monotonic()))
    assert built and len(calls) >= 2


def test_a_failed_build_says_why(monkeypatch):
    """A compiler error surfaces as CpuOpsUnavailable naming the cause; so does a missing compiler."""
    monkeypatch.setattr(cpu_ext, "ops_loaded", lambda: False)

    def broken():
        raise RuntimeError("Error building extension 'ringserve_cpu_x': cc1plus: fatal error")

    monkeypatch.setattr(cpu_ext, "_build", broken)
    with pytest.raises(cpu_ext.CpuOpsUnavailable, match="cc1plus"):
        cpu_ext.load_cpu_ops()
    monkeypatch.undo()
    monkeypatch.setattr(cpu_ext, "ops_loaded", lambda: False)
    monkeypatch.setattr(cpu_ext.shutil, "which", lambda name: None)
    with pytest.raises(cpu_ext.CpuOpsUnavailable, match="no C\\+\\+ compiler"):
        cpu_ext.load_cpu_ops()


def test_engine_serves_with_the_reference_when_kernels_cannot_be_built(tiny_model_dir, monkeypatch):
    """build_executor falls back to the torch reference path, and says so, when the build fails."""
    import torch

    from ringserve.config import Config
    from ringserve.gpu_proc.executor import build_executor

    def unavailable(progress=None):
        raise cpu_ext.CpuOpsUnavailable("no C++ compiler found")

    monkeypatch.setattr(cpu_ext, "load_cpu_ops", unavailable)
    before = torch.get_num_threads()
    try:
        engine = build_executor(Config(device="cpu", num_blocks=16), tiny_model_dir)
    finally:
        torch.set_num_threads(before)
    model = engine.runner.model
    assert model.backend.name == "reference" and not model.fused


def test_extension_name_follows_the_sources(monkeypatch):
    """Another source text (or flag) gives another extension name, so a stale build is never loaded."""
    name = cpu_ext.extension_name()
    monkeypatch.setattr(cpu_ext, "CFLAGS", cpu_ext.CFLAGS + ("-DRINGSERVE_TEST",))
    assert cpu_ext.extension_name() != name and name.startswith("ringserve_cpu_")


@pytest.mark.parametrize("threads", [1, 2])
def test_the_kernels_run_on_torchs_thread_count(threads):
    """A kernel's parallel_for runs on as many threads as torch.set_num_threads gives (cpu_threads):
    without -fopenmp in the extension's flags ATen's parallel_for compiles to a serial loop, and it
    reports 1 at 2 threads."""
    from ringserve.gpu_proc.cpu_ext import load_cpu_ops

    load_cpu_ops()
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        assert torch.ops.ringserve_cpu.parallel_width(64) == threads
    finally:
        torch.set_num_threads(before)
