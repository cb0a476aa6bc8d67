"""The real engine under the real scheduler: prefix caching on and off stream identical tokens
(greedy and seeded), while caching on really serves prompt tokens from cached blocks."""

from __future__ import annotations

import pytest

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import SamplingParams
from tests.helpers.engine_loop import serve_until_idle

SYSTEM = [(5 + 7 * k) % 200 + 3 for k in range(40)]  # a shared 40-token "system prompt"


def _serve(model_dir, prefix_caching: bool, temperature: float, num_blocks: int = 64):
    """Serve one request, then five more sharing its system prompt (two with n = 2); every
    request's streams and the scheduler's final stats."""
    config = Config(
        num_blocks=num_blocks,
        max_rows=8,
        prefill_budget=16,
        context_limit=512,
        max_tokens_limit=64,
        prefix_caching=prefix_caching,
    )
    engine = build_executor(config, model_dir)
    sched = Scheduler(
        config, BlockManager(num_blocks, config.block_size), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0
    )
    out: dict[tuple[int, int], list[int]] = {}

    def submit(i: int, n: int = 1) -> None:
        req = Request(
            key=(0, i),
            request_id=str(i),
            tenant="t",
            prompt_ids=SYSTEM + [10 + i] * (3 + i),
            max_tokens=12,
            n=n,
            arrival_ts=0.0,
            deadline_ts=1e9,
            sampling=SamplingParams(temperature=temperature, top_p=0.95, seed=100 + i, ignore_eos=True),
        )
        assert sched.admit(req).accepted

    submit(0)
    serve_until_idle(sched, engine, out, max_steps=500)
    for i in range(1, 6):
        submit(i, n=2 if i % 3 == 0 else 1)
    serve_until_idle(sched, engine, out, max_steps=500)
    assert sched.kv.bm.num_free == num_blocks
    return out, sched.stats()


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_prefix_caching_on_and_off_stream_identical_tokens(tiny_model_dir, temperature):
    """Same prompts, same seeds: caching changes which blocks are computed, never the tokens."""
    on, on_stats = _serve(tiny_model_dir, True, temperature)
    off, off_stats = _serve(tiny_model_dir, False, temperature)
    assert on == off
    assert len(on) == 7 and all(len(t) == 12 for t in on.values())
    assert on_stats.prefix_cache_hits >= 5 * 32  # each later request reused two 16-token blocks
    assert off_stats.prefix_cache_queries == 0
    assert on_stats.prompt_tokens_total == off_stats.prompt_tokens_total


def test_prefix_caching_with_preemption_streams_identical_tokens(tiny_model_dir):
    """A pool too small for every row: preempted requests recompute from cached blocks and the
    seeded streams still equal the caching-off run."""
    on, on_stats = _serve(tiny_model_dir, True, 0.9, num_blocks=9)
    off, _ = _serve(tiny_model_dir, False, 0.9, num_blocks=9)
    assert on_stats.preemptions > 0
    assert on == off
