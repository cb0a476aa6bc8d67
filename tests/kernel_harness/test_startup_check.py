"""The start-up kernel check (`gpu_proc/attention/self_check.py`) on the CPU harness: the engine's
load verifies every attention op its model launches against the torch reference, and an op whose
kernel is wrong (a planted corruption of one kernel's output) is served by the reference, so the
engine's tokens stay the CPU reference engine's."""

from __future__ import annotations

import random

import msgspec
import pytest
import torch

from ringserve.config import Config
from ringserve.gpu_proc.attention import kernels_backend
from ringserve.gpu_proc.attention.cupy_backend import AttentionKernels
from ringserve.gpu_proc.attention.self_check import KernelCheckFatal, check_kernels
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import GREEDY, OfflineRequest, generate

from .executor import HarnessExecutor

GREEDY_TO_LENGTH = msgspec.structs.replace(GREEDY, ignore_eos=True)

CONFIG = Config(device="cpu", dtype="float32", num_blocks=64, cpu_kernels=False)


class Corrupting(HarnessExecutor):
    """The harness, with every buffer one kernel writes nudged after it runs (a wrong kernel)."""

    def __init__(self, prefix: str, raises: bool = False) -> None:
        super().__init__(order="random", seed=5, sm_count=2, ctas_per_sm=2)
        self.prefix, self.raises = prefix, raises

    def launch(self, name, device, grid, block, args):
        if name.startswith(self.prefix) and self.raises:
            raise RuntimeError(f"{name}: an illegal memory access was encountered (planted)")
        super().launch(name, device, grid, block, args)
        if name.startswith(self.prefix):
            _, params = self.module.kernels[name]
            for arg, p in zip(args, params):
                if isinstance(arg, torch.Tensor) and p.kind == 0 and not p.is_const and arg.is_floating_point():
                    arg.add_(0.25)


def _requests(vocab: int) -> list[OfflineRequest]:
    rng = random.Random(3)
    return [
        OfflineRequest(prompt_ids=[rng.randrange(3, vocab) for _ in range(n)], max_tokens=8, sampling=GREEDY_TO_LENGTH)
        for n in (5, 40, 70, 1)
    ]


def _tokens(runner: ModelRunner, vocab: int) -> list[list[int]]:
    reqs = _requests(vocab)
    return [r.token_ids for r in generate(runner, reqs, eos_token_ids=frozenset(), prefill_budget=32, block_seed=1)]


@pytest.fixture(scope="module")
def reference_tokens(tiny_model_dir):
    model = load_model(tiny_model_dir, "cpu", torch.float32, cpu_kernels=False)
    a = model.args
    runner = ModelRunner(model, KVPool(a.num_layers, 64, a.num_kv_heads, a.head_dim))
    return _tokens(runner, a.vocab_size)


def test_correct_kernels_pass_and_serve_every_op(tiny_model_dir, reference_tokens):
    """Unplanted, every op passes, the kernels serve all of it, and the tokens are the reference's."""
    executor = HarnessExecutor(order="random", seed=5, sm_count=2, ctas_per_sm=2)
    engine = build_executor(CONFIG, tiny_model_dir, kernels=AttentionKernels(executor))
    assert engine.attention["failures"] == []
    assert engine.attention["ops"] == dict.fromkeys(("write_kv", "decode", "prefill", "mixed"), "cupy")
    assert engine.runner.model.backend.name == "cupy"
    assert _tokens(engine.runner, engine.vocab_size) == reference_tokens


# planted kernel -> the ops whose checks it fails, and what then serves each op
PLANTS = {
    "rs_paged_decode": {"write_kv": "cupy", "decode": "reference", "prefill": "cupy", "mixed": "cupy prefill"},
    "rs_paged_prefill": {"write_kv": "cupy", "decode": "cupy", "prefill": "reference", "mixed": "reference"},
    "rs_kv_append": {"write_kv": "reference", "decode": "cupy", "prefill": "cupy", "mixed": "cupy"},
}


@pytest.mark.parametrize("prefix", PLANTS)
def test_a_wrong_kernel_is_caught_and_its_op_served_by_the_reference(tiny_model_dir, reference_tokens, prefix):
    """A planted corruption of one kernel's output fails the checks of the ops that launch it, which
    name the kernel, its worst error and the shape; the engine serves those ops without it and its
    tokens are the reference engine's, where the wrong kernel's own tokens are not."""
    engine = build_executor(CONFIG, tiny_model_dir, kernels=AttentionKernels(Corrupting(prefix)))
    facts = engine.attention
    assert facts["ops"] == PLANTS[prefix]
    failed = {f["op"] for f in facts["failures"]}
    assert failed == {op for op, by in PLANTS[prefix].items() if by != "cupy"}
    for failure in facts["failures"]:
        assert any(k.startswith(prefix) for k in failure["kernels"]) or failure["op"] == "mixed"
        assert failure["worst_error"] >= 0.2 and "heads 4/2, head_dim 32" in failure["shape"]
    assert engine.runner.model.backend.name == "cupy+reference"
    assert _tokens(engine.runner, engine.vocab_size) == reference_tokens

    wrong = load_model(tiny_model_dir, "cpu", torch.float32, cpu_kernels=False)
    wrong.setup("cpu", kernels_backend(AttentionKernels(Corrupting(prefix))))
    a = wrong.args
    assert _tokens(ModelRunner(wrong, KVPool(a.num_layers, 64, a.num_kv_heads, a.head_dim)), a.vocab_size) != (
        reference_tokens
    ), "the planted corruption must change the tokens, or this test proves nothing"


def test_a_launch_that_raises_falls_back_with_the_error_named(tiny_model_dir, reference_tokens):
    """A kernel whose launch raises is reported with the exception and served by the reference."""
    engine = build_executor(
        CONFIG, tiny_model_dir, kernels=AttentionKernels(Corrupting("rs_paged_prefill", raises=True))
    )
    failures = {f["op"]: f for f in engine.attention["failures"]}
    assert set(failures) == {"prefill", "mixed"} and "illegal memory access" in failures["prefill"]["error"]
    assert _tokens(engine.runner, engine.vocab_size) == reference_tokens


class NoCompiler(HarnessExecutor):
    def compile(self, names, device, progress=None):
        raise RuntimeError("NVRTC_ERROR_COMPILATION (planted)")


def test_kernels_that_do_not_compile_leave_the_reference_serving(tiny_model_dir, reference_tokens):
    """A compile failure is no crash loop: the reference serves every op and the error is published."""
    engine = build_executor(CONFIG, tiny_model_dir, kernels=AttentionKernels(NoCompiler()))
    assert set(engine.attention["ops"].values()) == {"reference"}
    assert engine.attention["failures"] == [
        {"op": "compile", "error": "RuntimeError: NVRTC_ERROR_COMPILATION (planted)"}
    ]
    assert _tokens(engine.runner, engine.vocab_size) == reference_tokens
    with pytest.raises(KernelCheckFatal, match="do not compile"):
        build_executor(CONFIG.replace(require_kernels=True), tiny_model_dir, kernels=AttentionKernels(NoCompiler()))


def test_require_kernels_makes_a_failed_check_fatal(tiny_model_dir):
    """With --require-kernels a wrong kernel stops the start, naming the op and the kernel."""
    config = CONFIG.replace(require_kernels=True)
    with pytest.raises(KernelCheckFatal, match=r"decode kernel check failed \(rs_paged_decode<"):
        build_executor(config, tiny_model_dir, kernels=AttentionKernels(Corrupting("rs_paged_decode")))


def test_reference_backend_runs_no_kernel(tiny_model_dir):
    """--attention-backend reference serves every op with the reference and launches nothing."""
    executor = HarnessExecutor()
    engine = build_executor(
        CONFIG.replace(attention_backend="reference"), tiny_model_dir, kernels=AttentionKernels(executor)
    )
    assert engine.attention == {
        "backend": "reference",
        "ops": dict.fromkeys(("write_kv", "decode", "prefill", "mixed"), "reference"),
        "checked": False,
        "failures": [],
    }
    assert executor.launches == []


def test_cupy_backend_needs_a_cuda_device(tiny_model_dir):
    """--attention-backend cupy on a CPU device is refused with the reason."""
    with pytest.raises(RuntimeError, match="needs a CUDA device"):
        build_executor(CONFIG.replace(attention_backend="cupy"), tiny_model_dir)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_the_check_passes_in_half_precision_with_gqa(dtype):
    """Half precision on tensor cores (sm_90) and CUDA cores (sm_75), GQA 4, passes the check."""
    for capability in ((9, 0), (7, 5)):
        kernels = AttentionKernels(HarnessExecutor(order="reverse", capability=capability))
        checks = check_kernels(kernels, dtype, 64, 8, 2, torch.device("cpu"), {})
        assert [c.op for c in checks if not c.ok] == [], checks
