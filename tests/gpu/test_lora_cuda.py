"""The LoRA kernels on CUDA (lora_sgmv.cu through gpu_proc/lora_cuda.py): each dtype against the
float64 spec with base-model tokens untouched, the start-up check, and a tiny model with four
PEFT adapters and the base model mixed in one run through the kernels, equal to transformers +
PEFT greedily (float32)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from ringserve.gpu_proc.lora_cuda import check_lora_kernels, default_kernels, reference_add_  # noqa: E402
from tests.helpers.lora_adapters import ADAPTERS, make_adapters, peft_greedy  # noqa: E402
from tests.kernel_harness.test_lora_kernels import assert_lora_close, make  # noqa: E402

CUDA = torch.device("cuda")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_lora_add_matches_float64_on_cuda(dtype):
    kernels = default_kernels()
    kernels.compile(dtype, CUDA)
    assert check_lora_kernels(kernels, dtype, CUDA) is None
    segs = (576, 192, 192)
    x, y, a, bt, slot_of = make(segs, 16, 576, 37, 4, dtype, seed=3)
    want = y.clone()
    reference_add_(x, want, a, bt, slot_of)
    got = y.to(CUDA)
    kernels.add_(x.to(CUDA), got, a.to(CUDA), bt.to(CUDA), slot_of.to(CUDA), segs)
    assert_lora_close(got.cpu(), want, y, slot_of, dtype, f"CUDA {dtype}")


def test_a_model_with_mixed_adapters_on_cuda_is_peft(tiny_model_dir, tmp_path):
    from ringserve.gpu_proc.kv_pool import KVPool
    from ringserve.gpu_proc.lora import LoraRegistry
    from ringserve.gpu_proc.model.loader import load_model
    from ringserve.gpu_proc.model_runner import ModelRunner
    from ringserve.gpu_proc.offline import OfflineRequest, generate
    from ringserve.shm.messages import SamplingParams

    adapters = make_adapters(tiny_model_dir, tmp_path)
    prompts = [[1, 5, 9, 13, 17], [2, 4, 6]]
    want = {n: peft_greedy(tiny_model_dir, adapters.get(n), prompts, 8) for n in [None, *ADAPTERS]}
    model = load_model(tiny_model_dir, device="cuda", dtype=torch.float32)
    a = model.args
    loras = LoraRegistry(a, 4, 16, model.device, model.dtype)
    for name, path in adapters.items():
        loras.load(name, path)
    loras.kernels = default_kernels()
    loras.kernels.compile(torch.float32, CUDA)
    runner = ModelRunner(
        model, KVPool(a.num_layers, 128, a.num_kv_heads, a.head_dim, dtype=model.dtype, device=CUDA), loras
    )
    jobs = [(n, p) for p in prompts for n in [None, *ADAPTERS]]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [OfflineRequest(prompt_ids=p, max_tokens=8, sampling=greedy, lora=n) for n, p in jobs]
    got = [r.token_ids for r in generate(runner, reqs, eos_token_ids=frozenset(), max_rows=len(jobs))]
    assert got == [want[n][prompts.index(p)] for n, p in jobs]
