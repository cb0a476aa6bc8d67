"""The real engine under the real scheduler: preemption and recompute leave seeded output unchanged."""

from __future__ import annotations

from ringserve.config import Config
from ringserve.gpu_proc.block_manager import BlockManager
from ringserve.gpu_proc.executor import build_executor
from ringserve.gpu_proc.request import Request
from ringserve.gpu_proc.scheduler import Scheduler
from ringserve.shm.messages import SamplingParams
from tests.helpers.engine_loop import serve_until_idle


def _run(model_dir, num_blocks: int, prompts: list[list[int]], max_tokens: int):
    """Serve `prompts` to completion with a pool of `num_blocks`; tokens per request and preemptions."""
    config = Config(num_blocks=num_blocks, max_rows=8, prefill_budget=16, context_limit=512, max_tokens_limit=256)
    engine = build_executor(config, model_dir)
    sched = Scheduler(
        config, BlockManager(num_blocks, config.block_size), eos_token_ids=engine.eos_token_ids, clock=lambda: 0.0
    )
    for i, prompt in enumerate(prompts):
        req = Request(
            key=(0, i),
            request_id=str(i),
            tenant="t",
            prompt_ids=prompt,
            max_tokens=max_tokens,
            sampling=SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, ignore_eos=True),
            arrival_ts=0.0,
            deadline_ts=1e9,
        )
        assert sched.admit(req).accepted
    streams: dict[tuple[int, int], list[int]] = {}
    serve_until_idle(sched, engine, streams)
    assert sched.kv.bm.num_free == num_blocks
    return {rid: streams[(rid, 0)] for rid in range(len(prompts))}, sched.preemptions


def test_preempted_seeded_output_equals_unpreempted(tiny_model_dir):
    """With a pool too small for all rows, preempted requests recompute and stream the same tokens."""
    prompts = [[7 + i] * (20 + 5 * i) for i in range(4)]
    roomy, roomy_preemptions = _run(tiny_model_dir, 256, prompts, max_tokens=40)
    tight, tight_preemptions = _run(tiny_model_dir, 12, prompts, max_tokens=40)
    assert roomy_preemptions == 0
    assert tight_preemptions > 0
    assert tight == roomy
    assert all(len(t) == 40 for t in tight.values())
