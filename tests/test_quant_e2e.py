"""SmolLM2-135M-Instruct served from its GGUF blocks (Q4_1 projections, a Q8_0 embedding and tied
head: the default model's file), against the same weights dequantized (`--quantization none`).

What is checked: the model's memory is the blocks (at most 1.25x the GGUF file's tensor bytes); its
loglikelihood of a held text (the first 1,024 tokens of tools/data/english.txt) within 3 % of the dequantized
reference's; a real server says what it serves (/health, the model card) and its greedy tokens are
the in-process quantized model's. Greedy agreement with the reference is printed, not gated: the
int8 activations change near-ties, as llama.cpp's do.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import requests

from ringserve.config import Config
from ringserve.gpu_proc.cpu_ext import load_cpu_ops
from ringserve.gpu_proc.executor import served_kv_dtype, weights_bytes
from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import GREEDY, OfflineRequest, generate, loglikelihood
from tests.helpers.server import ServerProcess

TEXT = Path(__file__).resolve().parents[1] / "tools" / "data" / "english.txt"
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time,", "List three colors:")


@pytest.fixture(scope="module")
def runners(smollm2_dir):
    load_cpu_ops()
    out = {}
    for mode in ("auto", "none"):
        model = load_model(smollm2_dir, "cpu", quantization=mode)
        a = model.args
        # the blocks with the cache a server gives them (bfloat16 where the CPU has its dot products)
        kv = served_kv_dtype(Config(), model)
        out[mode] = ModelRunner(model, KVPool(a.num_layers, 160, a.num_kv_heads, a.head_dim, dtype=kv))
    return out


@pytest.fixture(scope="module")
def codec(smollm2_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))


def test_the_model_is_its_blocks(runners, smollm2_gguf):
    import gguf

    q = runners["auto"].model
    assert q.weights_served() == {"quantization": "gguf", "formats": {"Q4_1": 210, "Q8_0": 1}, "dtype": "float32"}
    tensor_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(smollm2_gguf)).tensors)
    assert weights_bytes(q) <= 1.25 * tensor_bytes, (weights_bytes(q), tensor_bytes)
    print(f"\nweights served: {weights_bytes(q) / 2**20:.1f} MiB; the GGUF's tensors {tensor_bytes / 2**20:.1f} MiB")


def test_loglikelihood_of_a_held_text_within_3_percent(runners, codec):
    ids = codec.encode(TEXT.read_text()).ids[:1024]
    lq, lr = loglikelihood(runners["auto"], ids), loglikelihood(runners["none"], ids)
    print(
        f"\nloglikelihood of {len(ids)} tokens: quantized {lq:.1f}, dequantized {lr:.1f} ({(lq - lr) / abs(lr):+.2%})"
    )
    assert abs(lq - lr) <= 0.03 * abs(lr)


def test_a_server_serves_the_blocks(runners, codec, smollm2_dir, tmp_path):
    prompts = [codec.encode(p).ids for p in PROMPTS]
    reqs = [OfflineRequest(prompt_ids=p, max_tokens=24, sampling=GREEDY) for p in prompts]
    want = [r.token_ids for r in generate(runners["auto"], reqs, eos_token_ids=frozenset())]
    ref = [r.token_ids for r in generate(runners["none"], reqs, eos_token_ids=frozenset())]
    agree = [next((i for i, (a, b) in enumerate(zip(w, r)) if a != b), len(w)) for w, r in zip(want, ref)]
    print(f"\ngreedy tokens equal to the dequantized reference's before the first difference: {agree} of 24")
    with ServerProcess(
        smollm2_dir, tmp_path, workers=1, queue_limit_s=600, ready_timeout_s=300, quantization="auto"
    ) as srv:
        health = requests.get(f"{srv.url}/health", timeout=10).json()
        assert health["weights"]["quantization"] == "gguf" and health["weights"]["formats"] == {"Q4_1": 210, "Q8_0": 1}
        assert health["kv_cache_dtype"] == str(runners["auto"].kv_pool.dtype).removeprefix("torch.")
        card = requests.get(f"{srv.url}/v1/models", timeout=10).json()["data"][0]
        assert card["quantization"] == "gguf"
        for ids, tokens in zip(prompts, want):
            body = {"prompt": ids, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
            got = requests.post(f"{srv.url}/v1/completions", json=body, timeout=120).json()
            assert got["choices"][0]["text"] == codec.decode(tokens)
