"""A GGUF-quantized tiny model served from its blocks by the CUDA kernels' source on the CPU harness
(the module forward a CUDA device runs): its logits match the dequantized reference's, greedy tokens
are the same alone and in a batch, the start-up check passes the kernels and a failed check
dequantizes the layers."""

from __future__ import annotations

import pytest
import torch

from ringserve.gpu_proc.attention import reference_backend
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.gguf_convert import convert_gguf
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import OfflineRequest, generate, loglikelihood
from ringserve.gpu_proc.quant_cuda import CudaQuantEmbedding, CudaQuantLinear, QuantKernels, check_quant_kernels
from ringserve.shm.messages import SamplingParams
from tests.helpers.gguf_files import write_llama_gguf

from .executor import HarnessExecutor

GREEDY = SamplingParams(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def q41_dir(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant_cuda")
    path = write_llama_gguf(tiny_model_dir, tmp / "q41.gguf", quant="Q4_1")
    return convert_gguf(path, tmp / "q41", say=lambda line: None)


def _runner(model_dir, quant_kernels=None, quantization="auto") -> ModelRunner:
    model = load_model(model_dir, "cpu", cpu_kernels=False, quantization=quantization, quant_kernels=quant_kernels)
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, 64, a.num_kv_heads, a.head_dim))


def test_the_tiny_model_runs_from_its_blocks_through_the_kernels(q41_dir):
    harness = HarnessExecutor(order="random", seed=4)
    q = _runner(q41_dir, QuantKernels(harness))
    ref = _runner(q41_dir, quantization="none")
    model = q.model
    kinds = {type(m) for m in model.modules()}
    assert {CudaQuantLinear, CudaQuantEmbedding} <= kinds
    assert model.weights_served()["formats"] == {"Q4_1": 4 * 7 + 2}  # the projections, embedding and head
    assert model.quantized_bytes > 0 and not model.quantized
    ids = list(range(3, 120, 3))  # 40 tokens: the prefill takes the dequantize + GEMM path
    lq, lr = loglikelihood(q, ids), loglikelihood(ref, ids)
    assert abs(lq - lr) <= 1e-3 * abs(lr), (lq, lr)
    assert {n.split("<")[0] for n in harness.launches} == {"rs_qdequant"}  # 40 rows: dequantize + GEMM
    prompts = [list(range(5, 5 + n)) for n in (1, 9)]
    reqs = [OfflineRequest(prompt_ids=p, max_tokens=4, sampling=GREEDY) for p in prompts]
    together = [r.token_ids for r in generate(q, reqs, eos_token_ids=frozenset())]
    assert together == [r.token_ids for r in generate(ref, reqs, eos_token_ids=frozenset())]
    assert generate(q, reqs[1:], eos_token_ids=frozenset())[0].token_ids == together[1]
    assert "rs_qgemv" in {n.split("<")[0] for n in harness.launches}  # the decode steps


def test_the_check_passes_the_kernels_and_a_reference_setup_dequantizes(q41_dir):
    harness = HarnessExecutor()
    q = _runner(q41_dir, QuantKernels(harness))
    checks = check_quant_kernels(q.model.quant_kernels, {"Q4_1"}, torch.float32, torch.device("cpu"))
    assert [c.op for c in checks] == ["quant Q4_1"] and all(c.ok for c in checks), checks
    ids = list(range(3, 60, 2))
    before = loglikelihood(q, ids)
    q.model.setup("cpu", reference_backend())  # no quant kernels: every layer dequantized
    assert not any(isinstance(m, (CudaQuantLinear, CudaQuantEmbedding)) for m in q.model.modules())
    assert q.model.weights_served()["quantization"] == "none"
    assert abs(loglikelihood(q, ids) - before) <= 1e-3 * abs(before)


class _OffByOne(QuantKernels):
    """A GEMV one unit off: what the start-up check must catch."""

    def gemv(self, x, blocks, bias=None):
        return super().gemv(x, blocks, bias) + 1


def test_a_failed_start_up_check_serves_the_weights_dequantized(q41_dir):
    from ringserve.gpu_proc.attention.self_check import KernelCheckFatal
    from ringserve.gpu_proc.quant_cuda import verify_model

    ok = _runner(q41_dir, QuantKernels(HarnessExecutor()))
    assert verify_model(ok.model, torch.device("cpu"), require=False) == {
        "served": "kernels",
        "formats": ["Q4_1"],
        "failures": [],
    }
    bad = _runner(q41_dir, _OffByOne(HarnessExecutor()))
    with pytest.raises(KernelCheckFatal, match="quant Q4_1"):
        verify_model(bad.model, torch.device("cpu"), require=True)
    facts = verify_model(bad.model, torch.device("cpu"), require=False)
    assert facts["served"] == "dequantized" and facts["failures"][0]["op"] == "quant Q4_1"
    assert not any(isinstance(m, (CudaQuantLinear, CudaQuantEmbedding)) for m in bad.model.modules())
    assert bad.model.weights_served()["quantization"] == "none" and not bad.model.device_blocks
    ids = list(range(3, 60, 2))
    assert abs(loglikelihood(bad, ids) - loglikelihood(ok, ids)) <= 1e-3 * abs(loglikelihood(ok, ids))
