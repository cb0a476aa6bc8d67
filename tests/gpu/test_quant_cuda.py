"""The quantized-projection kernels on CUDA: every format's GEMV against the float64 oracle and its
dequantization bit for bit `quant.dequantize`, the start-up check, and a GGUF-quantized tiny model
served from its blocks (loglikelihood near `--quantization none`'s, greedy tokens the same alone and
in a batch, the modules reading blocks, fewer bytes than fp16)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
cupy = pytest.importorskip("cupy")

from ringserve.gpu_proc.kv_pool import KVPool  # noqa: E402
from ringserve.gpu_proc.model.gguf_convert import convert_gguf  # noqa: E402
from ringserve.gpu_proc.model.loader import load_model  # noqa: E402
from ringserve.gpu_proc.model_runner import ModelRunner  # noqa: E402
from ringserve.gpu_proc.offline import OfflineRequest, generate, loglikelihood  # noqa: E402
from ringserve.gpu_proc.quant import dequantize  # noqa: E402
from ringserve.gpu_proc.quant_cuda import (  # noqa: E402
    GEMV_MAX_ROWS,
    CudaQuantLinear,
    check_quant_kernels,
    default_kernels,
    random_blocks,
)
from ringserve.shm.messages import SamplingParams  # noqa: E402
from tests.helpers.gguf_files import write_llama_gguf  # noqa: E402

CUDA = torch.device("cuda")
FORMATS = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
TOL = {torch.float16: (2e-3, 1e-2), torch.bfloat16: (1.5e-2, 2e-2), torch.float32: (2e-5, 1e-4)}


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_projection_matches_float64_and_dequantizes_exactly(fmt, dtype):
    k = default_kernels()
    gen = torch.Generator().manual_seed(3)
    blocks = random_blocks(fmt, 301, 4160, gen).to(CUDA)  # 130 blocks a row, rows past a CTA edge
    weight = dequantize(blocks)
    assert torch.equal(k.dequantize(blocks, dtype), weight.to(dtype))
    bias = torch.randn(301, generator=gen).to(dtype).to(CUDA)
    x = torch.randn(GEMV_MAX_ROWS + 9, 4160, generator=gen).to(dtype).to(CUDA)
    atol, rtol = TOL[dtype]
    for rows in (1, 5, 8, 17, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 9):
        got = k.linear(x[:rows], blocks, bias).double()
        want = x[:rows].double() @ weight.double().T + bias.double()
        bound = atol * max(1.0, float(want.abs().max())) + rtol * want.abs()
        assert bool(((got - want).abs() <= bound).all()), f"{fmt} {dtype} {rows} rows"
    batch = k.gemv(x[:9], blocks)
    assert torch.equal(k.gemv(x[4:5].contiguous(), blocks), batch[4:5]), "a row differs alone and in a batch"


def test_the_start_up_check_passes_every_format():
    checks = check_quant_kernels(default_kernels(), FORMATS, torch.bfloat16, CUDA)
    assert all(c.ok for c in checks), [c for c in checks if not c.ok]


@pytest.fixture(scope="module")
def q41_dir(tiny_model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("quant_gpu")
    return convert_gguf(
        write_llama_gguf(tiny_model_dir, tmp / "q41.gguf", quant="Q4_1"), tmp / "q41", say=lambda s: None
    )


def _runner(model_dir, quantization: str, dtype=torch.float16) -> ModelRunner:
    model = load_model(model_dir, CUDA, dtype, quantization=quantization)
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, 256, a.num_kv_heads, a.head_dim, dtype=model.dtype, device=CUDA))


def test_a_quantized_model_is_served_from_its_blocks_on_cuda(q41_dir):
    q, ref = _runner(q41_dir, "auto"), _runner(q41_dir, "none")
    assert q.model.weights_served()["formats"] == {"Q4_1": 30}
    assert any(isinstance(m, CudaQuantLinear) for m in q.model.modules())
    assert q.model.quantized_bytes < 0.5 * sum(p.numel() * 2 for p in ref.model.parameters())
    ids = list(range(3, 300, 3))
    lq, lr = loglikelihood(q, ids), loglikelihood(ref, ids)
    assert abs(lq - lr) <= 0.01 * abs(lr), (lq, lr)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    # 24 prompt tokens in all: every step stays on the GEMV (above 32 rows cuBLAS picks its kernel
    # by shape, as for float weights, and a row's bits may differ between step sizes)
    reqs = [OfflineRequest(prompt_ids=list(range(5, 5 + n)), max_tokens=16, sampling=greedy) for n in (1, 9, 14)]
    together = [r.token_ids for r in generate(q, reqs, eos_token_ids=frozenset())]
    for r, want in zip(reqs, together):
        assert generate(q, [r], eos_token_ids=frozenset())[0].token_ids == want
