"""Embeddings in the engine (scheduler + executor on the tiny model): the `Pooled` sums a pooling
request's chunks send cover every prompt position exactly once (mean) or the last one (last), and
equal transformers' final hidden states: over several prefill chunks, across a preemption in the
middle of the prompt, for a one-token prompt and for a prompt whose cached prefix leaves one token
(both run as decode-shaped rows)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import Pooled, SamplingParams

CONFIG = Config(num_blocks=64, max_rows=8, prefill_budget=16, context_limit=1024, dtype="float32")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return build_executor(CONFIG, tiny_model_dir)


@pytest.fixture(scope="module")
def hidden(tiny_model_dir):
    from transformers import AutoModel

    hf = AutoModel.from_pretrained(str(tiny_model_dir), dtype="float32").eval()

    def run(ids: list[int]) -> np.ndarray:
        with torch.no_grad():
            return hf(torch.tensor([ids])).last_hidden_state[0].double().numpy()

    return run


def _request(i: int, prompt: list[int], pooling: str) -> Request:
    return Request(
        key=(0, i),
        request_id=str(i),
        tenant="t",
        prompt_ids=prompt,
        max_tokens=1,
        sampling=SamplingParams(temperature=0.0),
        arrival_ts=0.0,
        deadline_ts=1e9,
        pooling=pooling,
    )


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(11 + 17 * k + salt) % 900 + 3 for k in range(n)]


def _run(sched: Scheduler, engine, preempt: tuple[Request, int] | None = None) -> dict[int, list[Pooled]]:
    out: dict[int, list[Pooled]] = {}
    preempted = False
    while sched.has_work:
        if preempt is not None and not preempted and preempt[0].prompt_pooled > preempt[1]:
            sched._preempt(preempt[0])  # what a decoding row short of a block does to the newest request
            preempted = True
        batch = sched.schedule()
        for _, ev in sched.update(engine.step(batch) if batch.seqs else None):
            if isinstance(ev, Pooled):
                out.setdefault(ev.rid, []).append(ev)
        sched.check_integrity()
    assert preempted == (preempt is not None)
    return out


def _pooled(events: list[Pooled], prompt_len: int, pooling: str) -> np.ndarray:
    covered = [p for e in events for p in range(e.start, e.start + e.count)]
    assert covered == (list(range(prompt_len)) if pooling == "mean" else [prompt_len - 1])  # each once, in order
    total = sum(np.frombuffer(e.values, "<f4").astype(np.float64) for e in events)
    return total / len(covered)


def _scheduler(engine) -> Scheduler:
    return Scheduler(CONFIG, BlockManager(64, 16), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0)


@pytest.mark.parametrize("preempt_at", [None, 130])
def test_mean_and_last_pooling_equal_transformers_over_chunks(engine, hidden, preempt_at):
    long, short = _prompt(300), _prompt(1, 5)
    sched = _scheduler(engine)
    reqs = [_request(1, long, "mean"), _request(2, long, "last"), _request(3, short, "mean")]
    for r in reqs:
        assert sched.admit(r).accepted
    got = _run(sched, engine, (reqs[0], preempt_at) if preempt_at is not None else None)
    assert len(got[1]) >= 2  # pooled a chunk per step
    ref = hidden(long)
    np.testing.assert_allclose(_pooled(got[1], len(long), "mean"), ref.mean(0), atol=1e-5)
    np.testing.assert_allclose(_pooled(got[2], len(long), "last"), ref[-1], atol=1e-5)
    np.testing.assert_allclose(_pooled(got[3], 1, "mean"), hidden(short)[0], atol=1e-5)


def test_last_pooling_from_the_prefix_cache(engine, hidden):
    """33 tokens, 32 of them cached by an earlier request: the last one runs alone, as a decode row,
    and pools; a mean-pooling request of the same prompt takes no cache hits and pools all 33."""
    prompt = _prompt(33, 7)
    sched = _scheduler(engine)
    assert sched.admit(_request(1, prompt, "last")).accepted
    _run(sched, engine)
    hits = sched.kv.cache.hits
    assert sched.admit(_request(2, prompt, "last")).accepted
    got = _run(sched, engine)
    assert sched.kv.cache.hits > hits
    np.testing.assert_allclose(_pooled(got[2], 33, "last"), hidden(prompt)[-1], atol=1e-5)
    assert sched.admit(_request(3, prompt, "mean")).accepted
    got = _run(sched, engine)
    np.testing.assert_allclose(_pooled(got[3], 33, "mean"), hidden(prompt).mean(0), atol=1e-5)
