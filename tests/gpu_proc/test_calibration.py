"""Start-up calibration (`gpu_proc/calibration.py`): synthetic steps of every kind, timed on the
real (tiny) model before READY, become a usable prior for the step cost model."""

import torch

from ringserve.config import Config
from ringserve.gpu_proc import calibration
from ringserve.gpu_proc.cost_model import CostModel
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.step_shape import StepShape


def test_calibration_times_every_kind_of_step_and_leaves_the_pool_clean(tiny_model_dir):
    """Decode rows at short and long contexts, prefill chunks at the start and at an offset, and a
    mixed step, each its median time; the KV pool is all zeros afterwards, as the scheduler expects."""
    config = Config(device="cpu", num_blocks=512, cpu_kernels=False)
    executor = build_executor(config, tiny_model_dir)
    beats = []
    samples = calibration.calibrate(executor, 32, 256, 8192, progress=lambda: beats.append(1))
    kinds = {shape.kind for shape, _ in samples}
    assert kinds == {"decode", "prefill", "mixed"}
    assert len(samples) == 9 and all(ms > 0 for _, ms in samples)
    assert len(beats) == 9 * calibration.ROUNDS  # the watchdog hears from every step
    assert any(shape.reads > 32 * 500 for shape, _ in samples)  # a long context
    pool = executor.runner.kv_pool
    assert not torch.count_nonzero(pool.k_all) and not torch.count_nonzero(pool.v_all)
    cm = CostModel(calibration=samples)
    assert cm.problem() is None
    assert cm.step_ms(StepShape.chunk(0, 128)) > cm.step_ms(StepShape.chunk(0, 16)) > 0


def test_a_small_pool_and_a_short_context_still_calibrate(tiny_model_dir):
    """Shapes shrink to what the pool and the context hold; the prior still spans the coefficients."""
    config = Config(device="cpu", num_blocks=24, cpu_kernels=False, context_limit=256, max_rows=4)
    executor = build_executor(config, tiny_model_dir)
    samples = calibration.calibrate(executor, 4, 64, 256)
    assert len(samples) >= 4
    for shape, _ in samples:
        assert shape.reads <= 4 * 256 * 256
    assert CostModel(calibration=samples, max_rows=4, prefill_scale=64).problem() is None
