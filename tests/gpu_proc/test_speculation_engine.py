"""Speculative decoding on the real tiny model under the real scheduler: the tokens are the ones
plain decoding gives (greedy, seeded sampling, penalties), alone and batched, and greedy equals
transformers.generate."""

from __future__ import annotations

import pytest
import torch

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import SamplingParams
from tests.helpers.engine_loop import serve_until_idle

SPEC = {"speculative": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3}
BASE = [[3 + (k % 7) * 11 for k in range(30)], [5, 9, 13, 17, 21] * 5 + [40], [60 + k for k in range(12)] * 2, [7]]


@pytest.fixture(scope="module")
def engines(tiny_model_dir):
    base = Config(num_blocks=128, max_rows=8, prefill_budget=64, context_limit=256)
    return {on: (cfg, build_executor(cfg, tiny_model_dir)) for on, cfg in ((False, base), (True, base.replace(**SPEC)))}


@pytest.fixture(scope="module")
def prompts(engines):
    """Prompts that repeat themselves around the random model's own greedy continuation (P, its
    answer, P again): the model, which mostly follows its last tokens, then partly repeats that
    answer, so drafts from the prompt are sometimes right (a random model copies nothing else)."""
    answers, _ = _serve(engines, False, [SamplingParams(temperature=0.0, ignore_eos=True)] * len(BASE), BASE)
    return [p + answers[i] + p for i, p in enumerate(BASE)]


def _serve(engines, spec: bool, sampling: list[SamplingParams], prompts, max_tokens=24, together=True):
    """Serve one request per prompt (all at once, or one after the other): rid -> tokens, stats."""
    cfg, engine = engines[spec]
    sched = Scheduler(cfg, BlockManager(cfg.num_blocks, cfg.block_size), eos_token_ids=engine.eos_token_ids)
    out: dict = {}
    for i, (p, sp) in enumerate(zip(prompts, sampling)):
        req = Request(
            key=(0, i),
            request_id=str(i),
            tenant="t",
            prompt_ids=p,
            max_tokens=max_tokens,
            arrival_ts=0.0,
            deadline_ts=1e12,
            sampling=sp,
        )
        assert sched.admit(req).accepted
        if sp.grammar is not None:
            engine.grammar.compiler.wait(sp.grammar)
        if not together:
            serve_until_idle(sched, engine, out)
    serve_until_idle(sched, engine, out)
    assert sched.kv.bm.num_free == cfg.num_blocks
    return {rid: t for (rid, _), t in out.items()}, sched.stats()


def test_greedy_speculation_streams_the_plain_tokens_and_drafts_are_kept(engines, prompts):
    """Greedy rows stream the same tokens with speculation on, and its drafts were verified and
    partly kept."""
    sampling = [SamplingParams(temperature=0.0, ignore_eos=True)] * len(prompts)
    plain, _ = _serve(engines, False, sampling, prompts)
    spec, st = _serve(engines, True, sampling, prompts)
    assert spec == plain
    assert st.spec_decode_num_drafts > 0 and st.spec_decode_num_accepted_tokens > 0


@pytest.mark.parametrize("together", [True, False], ids=["batched", "alone"])
def test_seeded_sampling_with_speculation_repeats_plain_decoding(engines, prompts, together):
    """Seeded sampled rows (temperature, top-p, top-k, penalties) stream exactly what plain
    decoding streams for the same seeds, alone and batched: the draws are a function of (seed,
    index, position) and a draft is kept only where the draw agrees."""
    sampling = [
        SamplingParams(temperature=0.8, seed=11, ignore_eos=True),
        SamplingParams(temperature=0.7, top_p=0.9, seed=12, ignore_eos=True),
        SamplingParams(temperature=0.6, top_k=5, seed=13, ignore_eos=True, frequency_penalty=0.4),
        SamplingParams(temperature=0.0, seed=14, ignore_eos=True, repetition_penalty=1.3, presence_penalty=0.3),
    ]
    plain, _ = _serve(engines, False, sampling, prompts, together=together)
    spec, st = _serve(engines, True, sampling, prompts, together=together)
    assert spec == plain
    assert st.spec_decode_num_drafts > 0


def test_greedy_with_speculation_equals_transformers(engines, prompts, tiny_model_dir):
    """Greedy continuations served with speculation on equal transformers.generate (up to and
    including EOS, which ends a row in both)."""
    from transformers import LlamaForCausalLM

    sampling = [SamplingParams(temperature=0.0)] * len(prompts)
    spec, st = _serve(engines, True, sampling, prompts, max_tokens=20)
    assert st.spec_decode_num_accepted_tokens > 0
    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    for i, p in enumerate(prompts):
        x = torch.tensor([p])
        want = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=20, do_sample=False, pad_token_id=0)
        assert spec[i] == want[0, len(p) :].tolist(), f"prompt {i}"


def test_grammar_masks_apply_at_every_verified_position(engines, prompts):
    """Constrained rows (a regex the answer loops in, a JSON schema), greedy and seeded, stream
    with speculation what they stream without it, inside their grammar, and drafts were kept:
    each verified position's mask is its matcher's after the draft tokens before it."""
    import llguidance

    loop = llguidance.LLMatcher.grammar_from_regex(r"(ab|ba|aa)( (ab|ba|aa)){5,30}\.")
    schema = llguidance.LLMatcher.grammar_from_json_schema(
        {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"], "additionalProperties": False},
        defaults={"whitespace_flexible": False},
    )
    sampling = [
        SamplingParams(temperature=0.0, grammar=loop),
        SamplingParams(temperature=0.8, seed=3, grammar=loop),
        SamplingParams(temperature=0.0, grammar=schema),
        SamplingParams(temperature=0.0, ignore_eos=True),
    ]
    plain, _ = _serve(engines, False, sampling, prompts, max_tokens=40)
    spec, st = _serve(engines, True, sampling, prompts, max_tokens=40)
    assert spec == plain
    assert st.spec_decode_num_accepted_tokens > 0
