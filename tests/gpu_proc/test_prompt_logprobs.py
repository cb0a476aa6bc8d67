"""Prompt logprobs from the prefill chunks (real engine, real scheduler, the tiny model) against
transformers' full-sequence log-softmax on the same weights: across chunk boundaries, with the
per-step scoring allowance cutting chunks, with the prompt already in the prefix cache, and across
preemption; and seeded output with penalties repeating across preemption."""

from __future__ import annotations

import msgspec
import pytest
import torch

from ringserve.config import Config
from ringserve.gpu_proc import step_budget as step_budget_module
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import PromptLogprobs, SamplingParams, Token

TOP = 3


@pytest.fixture(scope="module")
def hf_logprobs(tiny_model_dir):
    """transformers' log-softmax over a whole prompt: prompt ids -> [len, vocab] float64."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def run(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([ids])).logits[0].double(), -1)

    return run


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(7 + 13 * k + salt) % 1000 + 3 for k in range(n)]


def _serve(
    model_dir,
    requests: list[Request],
    *,
    num_blocks: int = 256,
    prefill_budget: int = 16,
    prefix_caching: bool = True,
    engine=None,
):
    """Serve to completion; (prompt logprob events per key, tokens per key, scheduler)."""
    config = Config(
        num_blocks=num_blocks,
        max_rows=8,
        prefill_budget=prefill_budget,
        context_limit=1024,
        prefix_caching=prefix_caching,
    )
    engine = engine or build_executor(config, model_dir)
    sched = Scheduler(
        config, BlockManager(num_blocks, config.block_size), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0
    )
    for req in requests:
        assert sched.admit(req).accepted
    scores: dict = {}
    tokens: dict = {}
    for _ in range(3000):
        if not sched.has_work:
            break
        batch = sched.schedule()
        for slot, ev in sched.update(engine.step(batch) if batch.seqs else None):
            if isinstance(ev, PromptLogprobs):
                scores.setdefault((slot, ev.rid), []).append(ev)
            elif isinstance(ev, Token):
                tokens.setdefault((slot, ev.rid), []).append(ev.token_id)
        sched.check_integrity()
    assert not sched.has_work and sched.kv.bm.num_free == num_blocks
    return scores, tokens, sched


def _request(
    i: int, prompt: list[int], *, prompt_logprobs=TOP, max_tokens: int = 3, controls=None, seed: int = 0
) -> Request:
    """`controls`: a `SamplingParams` whose logits controls the request takes."""
    base = SamplingParams(temperature=0.8, seed=seed, ignore_eos=True)
    return Request(
        key=(0, i),
        request_id=str(i),
        tenant="t",
        prompt_ids=prompt,
        max_tokens=max_tokens,
        sampling=base
        if controls is None
        else msgspec.structs.replace(controls, temperature=0.8, seed=seed, ignore_eos=True),
        arrival_ts=0.0,
        deadline_ts=1e9,
        prompt_logprobs=prompt_logprobs,
    )


def _check(events: list[PromptLogprobs], prompt: list[int], ref: torch.Tensor) -> None:
    """Every prompt token from 1 on is scored exactly once, in order, as transformers scores it."""
    starts = [e.start for e in events]
    assert starts == sorted(starts) and starts[0] == 1
    logprobs = [x for e in events for x in e.logprobs]
    ranks = [x for e in events for x in e.ranks]
    tops = [x for e in events for x in e.top]
    assert len(logprobs) == len(prompt) - 1
    want = torch.tensor([ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))])
    torch.testing.assert_close(torch.tensor(logprobs, dtype=torch.float64), want.double(), atol=2e-4, rtol=1e-4)
    assert ranks == [int((ref[p - 1] >= ref[p - 1, prompt[p]]).sum()) for p in range(1, len(prompt))]
    assert [[t for t, _ in top] for top in tops] == [
        torch.topk(ref[p - 1], TOP).indices.tolist() for p in range(1, len(prompt))
    ]


@pytest.mark.parametrize("allowance", [None, 40])
def test_prompt_logprobs_equal_transformers_across_chunks(tiny_model_dir, hf_logprobs, monkeypatch, allowance):
    """A 300-token prompt prefilled in 128-token chunks (and, with a 40-token scoring allowance per
    step, in chunks cut to it) scores every token as the full-sequence forward does; a short
    request beside it is unaffected."""
    if allowance is not None:
        monkeypatch.setattr(step_budget_module, "PROMPT_LOGPROB_TOKENS_PER_STEP", allowance)
    prompt = _prompt(300)
    scores, tokens, _ = _serve(tiny_model_dir, [_request(1, prompt), _request(2, _prompt(20, 5), prompt_logprobs=None)])
    _check(scores[(0, 1)], prompt, hf_logprobs(prompt))
    assert len(scores[(0, 1)]) >= (8 if allowance else 3)  # really split over chunks
    assert (0, 2) not in scores and len(tokens[(0, 2)]) == 3


def test_prompt_logprobs_skip_the_prefix_cache(tiny_model_dir, hf_logprobs):
    """The same prompt already cached by an earlier request: the scoring request computes it all
    anyway (a cached block has no logits) and gets every logprob; the cache was really there (a
    third, plain request hits it)."""
    prompt = _prompt(100, 9)
    config = Config(num_blocks=256, max_rows=8, prefill_budget=16, context_limit=1024)
    engine = build_executor(config, tiny_model_dir)
    scores, _, sched = _serve(tiny_model_dir, [_request(1, prompt, prompt_logprobs=None)], engine=engine)
    assert scores == {}
    # A fresh scheduler over the same engine would not share the cache: use one scheduler throughout.
    for i, plp in ((2, TOP), (3, None)):
        hits = sched.kv.cache.hits
        assert sched.admit(_request(i, prompt, prompt_logprobs=plp)).accepted
        events = []
        while sched.has_work:
            batch = sched.schedule()
            events += [
                e for _, e in sched.update(engine.step(batch) if batch.seqs else None) if isinstance(e, PromptLogprobs)
            ]
        if plp:
            _check(events, prompt, hf_logprobs(prompt))
            assert sched.kv.cache.hits == hits
        else:
            assert sched.kv.cache.hits > hits


def test_prompt_logprobs_across_preemption_are_sent_once(tiny_model_dir, hf_logprobs, monkeypatch):
    """A request preempted in the middle of its prompt (scored 12 tokens a step) is recomputed from
    the start: no token is scored twice, the values are the same, and so are its seeded tokens."""
    monkeypatch.setattr(step_budget_module, "PROMPT_LOGPROB_TOKENS_PER_STEP", 12)
    prompt = _prompt(90, 4)
    config = Config(num_blocks=64, max_rows=8, prefill_budget=16, context_limit=1024)
    engine = build_executor(config, tiny_model_dir)
    results = []
    for preempt_at in (None, 40):
        sched = Scheduler(config, BlockManager(64, 16), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0)
        req = _request(1, prompt, max_tokens=12)
        assert sched.admit(req).accepted and sched.admit(_request(2, _prompt(20), prompt_logprobs=None)).accepted
        events, tokens, preempted = [], [], False
        while sched.has_work:
            if preempt_at is not None and not preempted and req.prompt_scored > preempt_at:
                sched._preempt(req)  # what a decoding row short of a block does to the newest request
                preempted = True
            batch = sched.schedule()
            for slot, ev in sched.update(engine.step(batch) if batch.seqs else None):
                if isinstance(ev, PromptLogprobs):
                    events.append(ev)
                elif isinstance(ev, Token) and (slot, ev.rid) == (0, 1):
                    tokens.append(ev.token_id)
            sched.check_integrity()
        assert preempted == (preempt_at is not None)
        _check(events, prompt, hf_logprobs(prompt))
        results.append(tokens)
    assert results[0] == results[1] and len(results[0]) == 12


def test_seeded_penalized_output_repeats_across_preemption(tiny_model_dir):
    """Penalties, bias and min_p on: seeded output alone with a roomy pool equals output under
    preemption, and differs from the same seeds without controls."""
    controls = SamplingParams(
        repetition_penalty=1.3,
        frequency_penalty=0.4,
        presence_penalty=0.3,
        min_p=0.02,
        logit_bias=((50, 1.5),),
        bad_words=((60, 61),),
    )
    prompts = [[11 + i] * (20 + 5 * i) for i in range(4)]

    def run(num_blocks, ctl):
        reqs = [
            _request(i, p, prompt_logprobs=None, max_tokens=40, controls=ctl, seed=100 + i)
            for i, p in enumerate(prompts)
        ]
        _, tokens, sched = _serve(tiny_model_dir, reqs, num_blocks=num_blocks)
        return tokens, sched.preemptions

    roomy, roomy_pre = run(256, controls)
    tight, tight_pre = run(12, controls)
    plain, _ = run(256, None)
    assert roomy_pre == 0 and tight_pre > 0
    assert tight == roomy and all(len(t) == 40 for t in tight.values())
    assert plain != roomy
