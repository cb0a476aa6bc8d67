"""Our Llama on the paged KV cache against Hugging Face transformers on the same checkpoint (CPU, fp32).

Tolerance: logits agree within atol 1e-4 + rtol 1e-4 (float32 differences in summation order;
logits here are O(10)), and greedy tokens are identical.
"""

from __future__ import annotations

import json

import pytest
import torch

from ringserve.gpu_proc.kv_pool import KVPool
from ringserve.gpu_proc.model.loader import load_model, read_special_tokens
from ringserve.gpu_proc.model_runner import ModelRunner
from ringserve.gpu_proc.offline import GREEDY, OfflineRequest, generate
from ringserve.gpu_proc.step import RowSampling, SeqStep, StepBatch
from ringserve.tools.commands.make_tiny_model import TinyModelSpec, build_tiny_model

TEXTS = [
    "",
    "The",
    "今天天气很好",
    "Hello 🙂 world! 🎉",
    "The lighthouse keeper climbed the tower twice to trim the lamp, although it did not need trimming.",
    "def fibonacci(n: int) -> list[int]:\n    numbers = [0, 1]\n",
    "A crow sat on the branch of a tree with a piece of cheese in her beak. " * 3,
    "東京は日本の首都です。서울은 한국의 수도입니다. Москва — столица России. " * 2,
    "Notes on the History of Timekeeping. For most of human history, people told the time by the sun. " * 6,
]
NEW_TOKENS = 20


def _prompts(model_dir):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return [tok.encode(t).ids for t in TEXTS]


def _runner(model_dir, num_blocks=256):
    model = load_model(model_dir, device="cpu")
    a = model.args
    return ModelRunner(model, KVPool(a.num_layers, num_blocks, a.num_kv_heads, a.head_dim))


def _hf(model_dir):
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_greedy(hf, ids, n):
    x = torch.tensor([ids])
    # An explicit mask: the BOS id may equal pad_token_id, which generate would otherwise mask out.
    out = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(ids) :].tolist()


def _last_logits(runner, prompts):
    """Each prompt prefilled whole in one batched step; logits of its last token."""
    seqs, nb = [], 0
    for i, ids in enumerate(prompts):
        need = (len(ids) + 15) // 16
        seqs.append(SeqStep(i, ids, 0, list(range(nb, nb + need)), RowSampling(temperature=0.0)))
        nb += need
    return runner.execute(StepBatch(seqs))


@pytest.fixture(params=["gqa", "mha"])
def model_dir(request, tiny_model_dir, tiny_mha_model_dir):
    return tiny_model_dir if request.param == "gqa" else tiny_mha_model_dir


def test_prompts_are_mixed_lengths(tiny_model_dir):
    """The comparison covers >= 8 prompts from 1 token (BOS) to several blocks long."""
    lens = sorted(len(p) for p in _prompts(tiny_model_dir))
    assert len(lens) >= 8 and lens[0] == 1 and lens[-1] > 64


def test_logits_match_transformers(model_dir):
    """Last-token logits of every prompt, run as one flat batch, match transformers."""
    prompts = _prompts(model_dir)
    ours = _last_logits(_runner(model_dir), prompts)
    hf = _hf(model_dir)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([ids])).logits[0, -1] for ids in prompts])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("speculative", ["off", "ngram"])
def test_greedy_tokens_match_transformers_generate(model_dir, speculative):
    """Greedy continuations, generated together with chunked prefill, equal transformers.generate
    (up to and including EOS), with n-gram speculative decoding on too."""
    prompts = _prompts(model_dir)
    runner = _runner(model_dir)
    eos = read_special_tokens(model_dir).eos_token_ids
    # EOS ends a row in both (transformers reads it from generation_config.json).
    reqs = [OfflineRequest(prompt_ids=p, max_tokens=NEW_TOKENS, sampling=GREEDY) for p in prompts]
    results = generate(runner, reqs, eos_token_ids=eos, prefill_budget=48, block_seed=5, speculative=speculative)
    hf = _hf(model_dir)
    for p, r in zip(prompts, results):
        assert r.token_ids == _hf_greedy(hf, p, NEW_TOKENS), f"prompt of {len(p)} tokens"


def test_llama3_rope_scaling_and_tied_embeddings_match_transformers(tmp_path):
    """A checkpoint with tied embeddings and llama3 rope scaling gives transformers' logits."""
    spec = TinyModelSpec(num_layers=1, tie_word_embeddings=True, num_kv_heads=1, seed=3)
    d = build_tiny_model(tmp_path / "m", spec)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    cfg["rope_theta"] = 500000.0
    (d / "config.json").write_text(json.dumps(cfg))
    prompts = [_prompts(d)[-1], _prompts(d)[4]]
    runner = _runner(d)
    assert runner.model.lm_head.weight is runner.model.model.embed_tokens.weight
    ours = _last_logits(runner, prompts)
    hf = _hf(d)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([ids])).logits[0, -1] for ids in prompts])
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
