"""`--kv-cache-dtype bfloat16` under a float32 model on the CPU: the pool is bfloat16 (half the
bytes), the fused forward reads it, the loglikelihood of a text stays near the float32 cache's,
greedy tokens are the same alone and in a batch; a combination the kernels cannot read is refused.
auto gives it to weights served as GGUF blocks where the CPU has bfloat16 dot products, and only
there."""

from __future__ import annotations

import pytest
import torch

from ringserve.config import Config, ConfigError
from ringserve.gpu_proc import cpu_ext
from ringserve.gpu_proc.executor import build_executor, kv_cache_dtype
from ringserve.gpu_proc.offline import OfflineRequest, generate, loglikelihood
from ringserve.shm.messages import SamplingParams
from tests.helpers.gguf_files import write_llama_gguf


def test_a_bfloat16_cache_under_a_float32_model(tiny_model_dir, caplog):
    caplog.set_level("INFO", logger="ringserve.gpu")
    base = dict(device="cpu", dtype="float32", num_blocks=64)
    bf16 = build_executor(Config(**base, kv_cache_dtype="bfloat16"), tiny_model_dir).runner
    f32 = build_executor(Config(**base), tiny_model_dir).runner
    assert bf16.kv_pool.dtype == torch.bfloat16 and f32.kv_pool.dtype == torch.float32
    assert bf16.model.dtype == torch.float32 and bf16.model.fused
    assert bf16.kv_pool.k_all.nbytes * 2 == f32.kv_pool.k_all.nbytes
    assert any("GiB (bfloat16)," in r.getMessage() for r in caplog.records)
    ids = list(range(3, 300, 3))
    lb, lf = loglikelihood(bf16, ids), loglikelihood(f32, ids)
    assert lb != lf and abs(lb - lf) <= 0.01 * abs(lf), (lb, lf)
    greedy = SamplingParams(temperature=0.0, ignore_eos=True)
    reqs = [OfflineRequest(prompt_ids=list(range(5, 5 + n)), max_tokens=10, sampling=greedy) for n in (1, 20, 45)]
    together = generate(bf16, reqs, eos_token_ids=frozenset())
    for r, want in zip(reqs, together):
        assert generate(bf16, [r], eos_token_ids=frozenset())[0].token_ids == want.token_ids


def test_the_combinations_the_kernels_cannot_read_are_refused():
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        Config(kv_cache_dtype="fp8")
    config = Config(kv_cache_dtype="bfloat16")
    assert kv_cache_dtype(config, torch.bfloat16, torch.device("cpu")) == torch.bfloat16
    with pytest.raises(RuntimeError, match="needs a float32 model on the CPU"):
        kv_cache_dtype(config, torch.float16, torch.device("cuda"))
    assert kv_cache_dtype(Config(), torch.float16, torch.device("cuda")) == torch.float16


def test_auto_gives_gguf_blocks_a_bfloat16_cache_where_the_cpu_dots_it(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from ringserve.gpu_proc.model.gguf_convert import convert_gguf

    print(f"\nthis CPU has bfloat16 dot products: {cpu_ext.cpu_bf16_dot()}")
    path = write_llama_gguf(tiny_model_dir, tmp_path / "q8.gguf", quant="Q8_0")
    blocks = convert_gguf(path, tmp_path / "q8", say=lambda line: None)
    monkeypatch.setattr(cpu_ext, "cpu_bf16_dot", lambda: True)  # the same answer on any CPU
    base = dict(device="cpu", dtype="float32", num_blocks=64)
    served = build_executor(Config(**base), blocks)
    assert served.weights()["quantization"] == "gguf" and served.runner.kv_pool.dtype == torch.bfloat16
    dequantized = build_executor(Config(**base, quantization="none"), blocks)
    assert dequantized.runner.kv_pool.dtype == torch.float32
    cpu, f32 = torch.device("cpu"), torch.float32
    assert kv_cache_dtype(Config(kv_cache_dtype="float32"), f32, cpu, quantized=True) == f32
    assert kv_cache_dtype(Config(), f32, torch.device("cuda"), quantized=True) == f32
    assert kv_cache_dtype(Config(), torch.bfloat16, cpu, quantized=True) == torch.bfloat16
    monkeypatch.setattr(cpu_ext, "cpu_bf16_dot", lambda: False)  # widening it first is no gain
    assert kv_cache_dtype(Config(), f32, cpu, quantized=True) == f32
    with pytest.raises(RuntimeError, match="float32 needs a float32 model"):
        kv_cache_dtype(Config(kv_cache_dtype="float32"), torch.bfloat16, cpu)
